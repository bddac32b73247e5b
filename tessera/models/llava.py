"""LLaVA: CLIP vision tower + projector + the language model that text_config.model_type names in
the text-model registry (Llama in LLaVA-1.5). Processing as in vLLM's multimodal guide.

Each `<image>` in the prompt becomes one image token per vision feature, i.e.
(image_size // patch_size)**2 (+1 for the CLS token with the "full" select strategy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

import torch
from torch import nn
from transformers import BatchFeature, LlavaConfig, LlavaProcessor

from tessera.layers.activations import get_activation
from tessera.layers.linear import Linear
from tessera.models.clip import CLIPVisionModel
from tessera.models.interfaces import MultiModalEmbeddings, SupportsMultiModal
from tessera.models.registry import ModelRegistry
from tessera.models.utils import module_dtype_device
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


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, config: LlavaConfig, num_feature_layers: int) -> None:
        super().__init__()
        bias = getattr(config, "multimodal_projector_bias", True)
        vision_hidden = config.vision_config.hidden_size * num_feature_layers
        self.linear_1 = Linear(vision_hidden, config.text_config.hidden_size, bias=bias)
        self.act = get_activation(config.projector_hidden_act)
        self.linear_2 = Linear(config.text_config.hidden_size, config.text_config.hidden_size, bias=bias)

    def forward(self, image_features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(image_features)))


@MULTIMODAL_REGISTRY.register_processor(
    LlavaMultiModalProcessor, info=LlavaProcessingInfo, dummy_inputs=LlavaDummyInputsBuilder
)
class LlavaForConditionalGeneration(nn.Module, SupportsMultiModal):
    multimodal_parts = {"vision": "vision_tower", "projector": "multi_modal_projector"}
    # Checkpoints saved by transformers >= 4.52 nest the parts under "model."; 5.x saves the CLIP
    # tower without its "vision_model." level. Map every layout to the hub's (first match wins).
    hf_to_tessera_prefixes = {
        "model.language_model.": "language_model.model.",
        "model.vision_tower.vision_model.": "vision_tower.vision_model.",
        "model.vision_tower.": "vision_tower.vision_model.",
        "vision_tower.vision_model.": "vision_tower.vision_model.",
        "vision_tower.": "vision_tower.vision_model.",
        "model.multi_modal_projector.": "multi_modal_projector.",
        "lm_head.": "language_model.lm_head.",
    }

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return "<image>" if modality == "image" else None

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.config = config
        layers = config.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(
                f"Unexpected vision_feature_select_strategy {config.vision_feature_select_strategy!r}; "
                "expected 'default' or 'full'."
            )
        if config.vision_config.model_type != "clip_vision_model":
            raise ValueError(f"Unsupported LLaVA vision tower {config.vision_config.model_type!r}; supported: CLIP")
        self.vision_tower = CLIPVisionModel(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config, len(self.feature_layers))
        self.language_model = ModelRegistry.build_language_model(config)
        self.placeholder_token_id = config.image_token_index

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def _image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, H, W] -> projected features [N, num_image_tokens, hidden]."""
        dtype, device = module_dtype_device(self.vision_tower)
        states = self.vision_tower(pixel_values.to(device=device, dtype=dtype), self.feature_layers)
        if self.config.vision_feature_select_strategy == "default":
            states = [s[:, 1:] for s in states]  # drop CLS
        features = torch.cat(states, dim=-1)
        dtype, device = module_dtype_device(self.multi_modal_projector)
        return self.multi_modal_projector(features.to(device=device, dtype=dtype))

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        pixel_values, image_embeds = kwargs.get("pixel_values"), kwargs.get("image_embeds")
        if image_embeds is not None:
            return image_embeds  # type: ignore[return-value]
        if pixel_values is None:
            return None
        if isinstance(pixel_values, (list, tuple)):
            pixel_values = torch.stack(list(pixel_values))
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 4:
            raise ValueError("pixel_values must be a (num_images, channels, height, width) tensor")
        return self._image_features(pixel_values)

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; items are merged into inputs_embeds by get_input_embeddings."""
        return self.language_model(input_ids, positions, inputs_embeds)
