"""Qwen2-VL: a 2-D rotary vision transformer whose patch merger emits language-model tokens, and a
Qwen2 decoder with M-RoPE positions. Processing as in vLLM's qwen2_vl.py.

The HF processor resizes each image to a multiple of patch_size * merge_size within
[min_pixels, max_pixels] (smart_resize) and cuts it into a [t, h, w] grid of patches (images:
t = 1, the frame repeated over temporal_patch_size); each `<|image_pad|>` of the prompt becomes
t * h * w / merge_size**2 pads, one per merged token. pixel_values is flat over all images
(item i: its t * h * w rows), image_grid_thw one row per image.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import nn
from transformers import BatchFeature, Qwen2VLConfig, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from tessera.models.interfaces import MultiModalEmbeddings, SupportsMRoPE, SupportsMultiModal
from tessera.models.mrope_positions import VisionGrid, mrope_input_positions
from tessera.models.qwen2_vl_vision import Qwen2VisionTransformer
from tessera.models.registry import ModelRegistry
from tessera.models.utils import module_dtype_device
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from tessera.multimodal.parse import ImageSize, MultiModalDataItems
from tessera.multimodal.processing import BaseMultiModalProcessor, BaseProcessingInfo, PromptReplacement, PromptUpdate
from tessera.multimodal.profiling import BaseDummyInputsBuilder

MAX_ASPECT_RATIO = 200  # smart_resize refuses longer sides


class Qwen2VLProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self) -> Qwen2VLConfig:
        return self.ctx.get_hf_config(Qwen2VLConfig)

    def get_hf_processor(self, **kwargs: object) -> Qwen2VLProcessor:
        return self.ctx.get_hf_processor(Qwen2VLProcessor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": None}

    def _resize_params(self) -> tuple[int, int, int, int]:
        """(patch_size, merge_size, min_pixels, max_pixels) of the image processor."""
        image_processor = self.get_hf_processor().image_processor
        size = getattr(image_processor, "size", None) or {}
        min_pixels = size.get("shortest_edge") or image_processor.min_pixels
        max_pixels = size.get("longest_edge") or image_processor.max_pixels
        return image_processor.patch_size, image_processor.merge_size, min_pixels, max_pixels

    def get_num_image_tokens(self, *, image_width: int, image_height: int) -> int:
        patch, merge, min_pixels, max_pixels = self._resize_params()
        height, width = smart_resize(image_height, image_width, patch * merge, min_pixels, max_pixels)
        return (height // patch) * (width // patch) // merge**2

    def get_image_size_with_most_features(self) -> ImageSize:
        """The most square size (in merge blocks) whose token count is the largest max_pixels allows."""
        patch, merge, _, max_pixels = self._resize_params()
        factor = patch * merge
        budget = max(max_pixels // factor**2, 1)
        best = (0, 0, 1, 1)  # (tokens, -aspect, h, w)
        for h in range(1, math.isqrt(budget) + 1):
            w = budget // h
            if max(h, w) / min(h, w) <= MAX_ASPECT_RATIO:
                best = max(best, (h * w, -max(h, w) / min(h, w), h, w))
        return ImageSize(width=best[3] * factor, height=best[2] * factor)

    def get_max_image_tokens(self) -> int:
        width, height = self.get_image_size_with_most_features()
        return self.get_num_image_tokens(image_width=width, image_height=height)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {"image": self.get_max_image_tokens()}


class Qwen2VLDummyInputsBuilder(BaseDummyInputsBuilder[Qwen2VLProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return self.info.get_hf_processor().image_token * mm_counts.get("image", 0)  # as vLLM: pads alone

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        width, height = self.info.get_image_size_with_most_features()
        return {"image": self._get_dummy_images(width=width, height=height, num_images=mm_counts.get("image", 0))}


class Qwen2VLMultiModalProcessor(BaseMultiModalProcessor[Qwen2VLProcessingInfo]):
    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        image_grid_thw = hf_inputs.get("image_grid_thw", torch.empty((0, 3)))
        return dict(
            pixel_values=MultiModalFieldConfig.flat_from_sizes("image", image_grid_thw.prod(-1)),
            image_grid_thw=MultiModalFieldConfig.batched("image"),
        )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        hf_config = self.info.get_hf_config()
        merge_size = hf_config.vision_config.spatial_merge_size
        image_items = out_mm_kwargs.get_items("image") if out_mm_kwargs.get_item_count("image") else []

        def get_replacement(item_idx: int) -> list[int]:
            grid_thw = image_items[item_idx]["image_grid_thw"].data
            return [hf_config.image_token_id] * (int(grid_thw.prod()) // merge_size**2)

        return [PromptReplacement(modality="image", target=[hf_config.image_token_id], replacement=get_replacement)]


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2VLMultiModalProcessor, info=Qwen2VLProcessingInfo, dummy_inputs=Qwen2VLDummyInputsBuilder
)
class Qwen2VLForConditionalGeneration(nn.Module, SupportsMultiModal, SupportsMRoPE):
    multimodal_parts = {"vision": "visual"}
    # transformers 5 saves (and hub checkpoints have) "model.*" for the decoder and "visual.*";
    # its in-memory layout nests both under "model." (first match wins).
    hf_to_tessera_prefixes = {
        "model.language_model.": "language_model.model.",
        "model.visual.": "visual.",
        "visual.": "visual.",
        "model.": "language_model.model.",
        "lm_head.": "language_model.lm_head.",
    }

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return "<|vision_start|><|image_pad|><|vision_end|>" if modality == "image" else None

    def __init__(self, config: Qwen2VLConfig) -> None:
        super().__init__()
        self.config = config
        text_config = config.text_config
        if not hasattr(text_config, "tie_word_embeddings"):  # transformers 5 keeps it on the outer config
            text_config.tie_word_embeddings = config.tie_word_embeddings
        self.visual = Qwen2VisionTransformer(config.vision_config)
        self.language_model = ModelRegistry.resolve_text_model_cls(text_config)(text_config)
        self.placeholder_token_id = config.image_token_id
        self.spatial_merge_size = config.vision_config.spatial_merge_size

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        """One [t * h * w / merge**2, hidden] tensor per image."""
        pixel_values, grid_thw = kwargs.get("pixel_values"), kwargs.get("image_grid_thw")
        if pixel_values is None:
            return None
        if isinstance(pixel_values, (list, tuple)):
            pixel_values = torch.cat(list(pixel_values))
        if isinstance(grid_thw, (list, tuple)):
            grid_thw = torch.stack([torch.as_tensor(g).reshape(3) for g in grid_thw])
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 2 or grid_thw is None:
            raise ValueError("pixel_values must be a (num_patches, patch_dim) tensor, with image_grid_thw")
        grid_thw = torch.as_tensor(grid_thw).reshape(-1, 3)
        dtype, device = module_dtype_device(self.visual)
        embeds = self.visual(pixel_values.to(device=device, dtype=dtype), grid_thw)
        sizes = (grid_thw.prod(-1) // self.spatial_merge_size**2).tolist()
        return list(embeds.split(sizes))

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: Sequence[Any]
    ) -> tuple[torch.Tensor, int]:
        """Each image's grid placed at its first embedding token (mrope_positions.py)."""
        grids = []
        for feature in mm_features:
            if feature.modality != "image":
                raise ValueError(f"Qwen2-VL takes images; got a {feature.modality}")
            position = feature.mm_position
            offset = position.offset
            if position.is_embed is not None:
                offset += int(torch.as_tensor(position.is_embed).nonzero()[0, 0])
            grid_thw = tuple(int(x) for x in torch.as_tensor(feature.data["image_grid_thw"].data).reshape(3))
            grids.append(VisionGrid(offset, grid_thw))
        return mrope_input_positions(len(input_tokens), grids, self.spatial_merge_size)

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; positions [3, T] (M-RoPE)."""
        return self.language_model(input_ids, positions, inputs_embeds)
