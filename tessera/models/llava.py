"""LLaVA: CLIP vision tower + projector + Llama. Processing as in vLLM's multimodal guide.

Each `<image>` in the prompt becomes one image token per vision feature, i.e.
(image_size // patch_size)**2 (+1 for the CLS token with the "full" select strategy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

from torch import nn
from transformers import BatchFeature, LlavaConfig, LlavaProcessor

from tessera.models.interfaces import SupportsMultiModal
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from tessera.multimodal.parse import ImageEmbeddingItems, ImageProcessorItems, ImageSize, MultiModalDataItems
from tessera.multimodal.processing import BaseMultiModalProcessor, BaseProcessingInfo, PromptReplacement, PromptUpdate
from tessera.multimodal.profiling import BaseDummyInputsBuilder


class LlavaProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self) -> LlavaConfig:
        return self.ctx.get_hf_config(LlavaConfig)

    def get_hf_processor(self, **kwargs: object) -> LlavaProcessor:
        return self.ctx.get_hf_processor(LlavaProcessor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": None}

    def get_num_image_tokens(self, *, image_width: int, image_height: int) -> int:
        # CLIP resizes and crops every image to a square, so the size does not matter.
        hf_config = self.get_hf_config()
        vision_config = hf_config.vision_config
        num_image_tokens = (vision_config.image_size // vision_config.patch_size) ** 2 + 1  # + CLS
        strategy = hf_config.vision_feature_select_strategy
        if strategy == "default":
            return num_image_tokens - 1
        if strategy == "full":
            return num_image_tokens
        raise ValueError(f"Unexpected vision_feature_select_strategy {strategy!r}; expected 'default' or 'full'.")

    def get_image_size_with_most_features(self) -> ImageSize:
        size = self.get_hf_config().vision_config.image_size
        return ImageSize(width=size, height=size)

    def get_max_image_tokens(self) -> int:
        width, height = self.get_image_size_with_most_features()
        return self.get_num_image_tokens(image_width=width, image_height=height)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {"image": self.get_max_image_tokens()}


class LlavaDummyInputsBuilder(BaseDummyInputsBuilder[LlavaProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return self.info.get_hf_processor().image_token * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        width, height = self.info.get_image_size_with_most_features()
        return {"image": self._get_dummy_images(width=width, height=height, num_images=mm_counts.get("image", 0))}


class LlavaMultiModalProcessor(BaseMultiModalProcessor[LlavaProcessingInfo]):
    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return dict(
            pixel_values=MultiModalFieldConfig.batched("image"),
            image_embeds=MultiModalFieldConfig.batched("image"),
        )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        image_token_id = self.info.get_hf_config().image_token_index

        def get_replacement(item_idx: int) -> list[int]:
            images = mm_items.get_items("image", (ImageEmbeddingItems, ImageProcessorItems))
            if isinstance(images, ImageEmbeddingItems):
                num_image_tokens = images.get_feature_size(item_idx)
            else:
                image_size = images.get_image_size(item_idx)
                num_image_tokens = self.info.get_num_image_tokens(
                    image_width=image_size.width, image_height=image_size.height
                )
            return [image_token_id] * num_image_tokens

        return [PromptReplacement(modality="image", target=[image_token_id], replacement=get_replacement)]


@MULTIMODAL_REGISTRY.register_processor(
    LlavaMultiModalProcessor, info=LlavaProcessingInfo, dummy_inputs=LlavaDummyInputsBuilder
)
class LlavaForConditionalGeneration(nn.Module, SupportsMultiModal):
    """Registered so that its processor can be found; model execution comes with the model code."""
