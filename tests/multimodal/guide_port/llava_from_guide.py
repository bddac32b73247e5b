# A LLaVA model file written for vLLM by following its multimodal guide, ported to Tessera by
# changing `vllm.multimodal` -> `tessera.multimodal` and `vllm.model_executor.models` ->
# `tessera.models` in the imports. Nothing else differs from the vLLM version.
from collections.abc import Mapping, Sequence
from typing import Optional

from torch import nn
from transformers import BatchFeature, LlavaConfig, LlavaProcessor

from tessera.models.interfaces import SupportsMultiModal
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from tessera.multimodal.parse import ImageProcessorItems, ImageSize, MultiModalDataItems
from tessera.multimodal.processing import (BaseMultiModalProcessor,
                                           BaseProcessingInfo,
                                           PromptReplacement, PromptUpdate)
from tessera.multimodal.profiling import (BaseDummyInputsBuilder,
                                          ProcessorInputs)


class GuideLlavaProcessingInfo(BaseProcessingInfo):

    def get_hf_config(self):
        return self.ctx.get_hf_config(LlavaConfig)

    def get_hf_processor(self, **kwargs: object):
        return self.ctx.get_hf_processor(LlavaProcessor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": None}

    def get_num_image_tokens(
        self,
        *,
        image_width: int,
        image_height: int,
    ) -> int:
        hf_config = self.get_hf_config()
        hf_processor = self.get_hf_processor()

        image_size = hf_config.vision_config.image_size
        patch_size = hf_config.vision_config.patch_size

        num_image_tokens = (image_size // patch_size)**2 + 1
        if hf_processor.vision_feature_select_strategy == "default":
            num_image_tokens -= 1

        return num_image_tokens

    def get_image_size_with_most_features(self) -> ImageSize:
        hf_config = self.get_hf_config()
        width = height = hf_config.vision_config.image_size
        return ImageSize(width=width, height=height)


class GuideLlavaDummyInputsBuilder(
        BaseDummyInputsBuilder[GuideLlavaProcessingInfo]):

    def get_dummy_processor_inputs(
        self,
        seq_len: int,
        mm_counts: Mapping[str, int],
    ) -> ProcessorInputs:
        num_images = mm_counts.get("image", 0)

        processor = self.info.get_hf_processor()
        image_token = processor.image_token
        target_width, target_height = \
            self.info.get_image_size_with_most_features()

        mm_data = {
            "image":
            self._get_dummy_images(width=target_width,
                                   height=target_height,
                                   num_images=num_images)
        }

        return ProcessorInputs(
            prompt_text=image_token * num_images,
            mm_data=mm_data,
        )


class GuideLlavaMultiModalProcessor(
        BaseMultiModalProcessor[GuideLlavaProcessingInfo]):

    def _get_mm_fields_config(
        self,
        hf_inputs: BatchFeature,
        hf_processor_mm_kwargs: Mapping[str, object],
    ) -> Mapping[str, MultiModalFieldConfig]:
        return dict(pixel_values=MultiModalFieldConfig.batched("image"), )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        hf_config = self.info.get_hf_config()
        image_token_id = hf_config.image_token_index

        def get_replacement(item_idx: int):
            images = mm_items.get_items("image", ImageProcessorItems)

            image_size = images.get_image_size(item_idx)
            num_image_tokens = self.info.get_num_image_tokens(
                image_width=image_size.width,
                image_height=image_size.height,
            )

            return [image_token_id] * num_image_tokens

        return [
            PromptReplacement(
                modality="image",
                target=[image_token_id],
                replacement=get_replacement,
            ),
        ]


@MULTIMODAL_REGISTRY.register_processor(
    GuideLlavaMultiModalProcessor,
    info=GuideLlavaProcessingInfo,
    dummy_inputs=GuideLlavaDummyInputsBuilder)
class GuideLlavaForConditionalGeneration(nn.Module, SupportsMultiModal):
    pass
