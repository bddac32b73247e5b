"""Fuyu: image patches embedded by one linear layer, fed inline to the decoder that
text_config.model_type names in the text-model registry (Persimmon).

There is no image placeholder in the user's prompt: the HF processor puts the image first, as a
grid of |SPEAKER| patch tokens with a |NEWLINE| after each row, then BOS, the text and the
beginning-of-answer token. Processing follows vLLM's multimodal guide.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Optional

import torch
from torch import nn
from transformers import BatchFeature, FuyuConfig, FuyuImageProcessor, FuyuProcessor

from tessera.layers.linear import Linear
from tessera.models.interfaces import MultiModalEmbeddings, SupportsMultiModal
from tessera.models.registry import ModelRegistry
from tessera.models.utils import module_dtype_device
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from tessera.multimodal.parse import ImageProcessorItems, ImageSize, MultiModalDataItems
from tessera.multimodal.processing import (
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
    PromptUpdateDetails,
)
from tessera.multimodal.profiling import BaseDummyInputsBuilder, ProcessorInputs

IMAGE_TOKEN = "|SPEAKER|"
NEWLINE_TOKEN = "|NEWLINE|"
BEGINNING_OF_ANSWER_TOKEN = "<0x04>"


class FuyuProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self) -> FuyuConfig:
        return self.ctx.get_hf_config(FuyuConfig)

    def get_hf_processor(self, **kwargs: object) -> FuyuProcessor:
        return self.ctx.get_hf_processor(FuyuProcessor, **kwargs)

    def get_image_processor(self) -> FuyuImageProcessor:
        return self.get_hf_processor().image_processor

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": 1}  # the HF processor lays out exactly one image per prompt

    def get_token_id(self, token: str) -> int:
        return self.get_tokenizer().convert_tokens_to_ids(token)

    def get_image_feature_grid_size(self, *, image_width: int, image_height: int) -> tuple[int, int]:
        """(columns, rows) of patches after the image processor's downscale-to-fit."""
        image_processor = self.get_image_processor()
        target_width = image_processor.size["width"]
        target_height = image_processor.size["height"]
        patch_width = image_processor.patch_size["width"]
        patch_height = image_processor.patch_size["height"]
        if not (image_width <= target_width and image_height <= target_height):
            scale = min(target_height / image_height, target_width / image_width)
            image_height = int(image_height * scale)
            image_width = int(image_width * scale)
        return math.ceil(image_width / patch_width), math.ceil(image_height / patch_height)

    def get_image_size_with_most_features(self) -> ImageSize:
        image_processor = self.get_image_processor()
        return ImageSize(width=image_processor.size["width"], height=image_processor.size["height"])


class FuyuDummyInputsBuilder(BaseDummyInputsBuilder[FuyuProcessingInfo]):
    def get_dummy_processor_inputs(self, seq_len: int, mm_counts: Mapping[str, int]) -> ProcessorInputs:
        target_width, target_height = self.info.get_image_size_with_most_features()
        num_images = mm_counts.get("image", 0)
        mm_data = {"image": self._get_dummy_images(width=target_width, height=target_height, num_images=num_images)}
        # The HF processor places the image itself: no placeholder text.
        return ProcessorInputs(prompt_text="", mm_data=mm_data)


class FuyuMultiModalProcessor(BaseMultiModalProcessor[FuyuProcessingInfo]):
    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        if not mm_data:
            # Text only: the HF processor would warn and skip the beginning-of-answer token.
            prompt_ids = self._apply_hf_processor_tokens_only(self.info.get_tokenizer().encode(prompt))
            return BatchFeature(dict(input_ids=[prompt_ids]), tensor_type="pt")

        processed_outputs = super()._call_hf_processor(prompt=prompt, mm_data=mm_data, mm_kwargs=mm_kwargs)
        image_patches = processed_outputs.get("image_patches")
        if image_patches is not None:
            images = mm_data["images"]
            assert isinstance(images, list)
            # Original output: (1, num_images, Pn, Px * Py * C); new output: (num_images, Pn, Px * Py * C)
            assert isinstance(image_patches, list) and len(image_patches) == 1
            assert len(image_patches[0]) == len(images)
            processed_outputs["image_patches"] = image_patches[0]
        return processed_outputs

    def _apply_hf_processor_tokens_only(self, prompt_tokens: list[int]) -> list[int]:
        # The HF processor appends the beginning-of-answer token to every prompt.
        return prompt_tokens + [self.info.get_token_id(BEGINNING_OF_ANSWER_TOKEN)]

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return dict(image_patches=MultiModalFieldConfig.batched("image"))

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        bos_token_id = self.info.get_hf_config().bos_token_id
        assert isinstance(bos_token_id, int)
        # The tokenizer's BOS is |ENDOFTEXT|; the HF processor replaces it with image + <s>.
        eot_token_id = self.info.get_tokenizer().bos_token_id
        assert isinstance(eot_token_id, int)
        image_token_id = self.info.get_token_id(IMAGE_TOKEN)
        newline_token_id = self.info.get_token_id(NEWLINE_TOKEN)

        def get_replacement_fuyu(item_idx: int) -> PromptUpdateDetails:
            images = mm_items.get_items("image", ImageProcessorItems)
            image_size = images.get_image_size(item_idx)
            ncols, nrows = self.info.get_image_feature_grid_size(
                image_width=image_size.width, image_height=image_size.height
            )
            image_tokens = ([image_token_id] * ncols + [newline_token_id]) * nrows
            return PromptUpdateDetails.select_token_id(image_tokens + [bos_token_id], embed_token_id=image_token_id)

        return [PromptReplacement(modality="image", target=[eot_token_id], replacement=get_replacement_fuyu)]


@MULTIMODAL_REGISTRY.register_processor(
    FuyuMultiModalProcessor, info=FuyuProcessingInfo, dummy_inputs=FuyuDummyInputsBuilder
)
class FuyuForCausalLM(nn.Module, SupportsMultiModal):
    multimodal_parts = {"vision": "vision_embed_tokens"}
    # Checkpoints saved by transformers >= 4.52 nest the parts under "model."; map them back.
    hf_to_tessera_prefixes = {
        "model.language_model.": "language_model.model.",
        "model.vision_embed_tokens.": "vision_embed_tokens.",
        "lm_head.": "language_model.lm_head.",
    }

    def __init__(self, config: FuyuConfig) -> None:
        super().__init__()
        self.config = config
        patch_dim = config.patch_size * config.patch_size * config.num_channels
        self.vision_embed_tokens = Linear(patch_dim, config.text_config.hidden_size)
        self.language_model = ModelRegistry.build_language_model(config)
        # The |SPEAKER| id is the tokenizer's and FuyuConfig 4.48 lacks it: merging by token id needs
        # it set; the engine merges by the placeholders' is_embed mask instead.
        self.placeholder_token_id: Optional[int] = getattr(config, "image_token_id", None)

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        image_patches = kwargs.get("image_patches")
        if image_patches is None:
            return None
        if isinstance(image_patches, torch.Tensor):
            image_patches = list(image_patches)  # [N, Pn, patch_dim] -> N items
        dtype, device = module_dtype_device(self.vision_embed_tokens)
        # one (num_patches, hidden) tensor per image: sizes differ between images
        return [self.vision_embed_tokens(p.to(device=device, dtype=dtype)) for p in image_patches]  # type: ignore

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; items are merged into inputs_embeds by get_input_embeddings."""
        return self.language_model(input_ids, positions, inputs_embeds)
