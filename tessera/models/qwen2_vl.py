"""Qwen2-VL: a 2-D rotary vision transformer whose patch merger emits language-model tokens, and a
Qwen2 decoder with M-RoPE positions. Processing as in vLLM's qwen2_vl.py.

The HF processor resizes each image to a multiple of patch_size * merge_size within
[min_pixels, max_pixels] (smart_resize) and cuts it into a [t, h, w] grid of patches (images:
t = 1, the frame repeated over temporal_patch_size); each `<|image_pad|>` of the prompt becomes
t * h * w / merge_size**2 pads, one per merged token. pixel_values is flat over all images
(item i: its t * h * w rows), image_grid_thw one row per image. Videos likewise: frames grouped by
temporal_patch_size (the last one repeated to fill a group), each `<|video_pad|>` becoming
t * h * w / merge_size**2 pads, pixel_values_videos flat, video_grid_thw one row per video. Our
frames go to the HF video processor as given (do_sample_frames=False).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from transformers import BatchFeature, Qwen2VLConfig, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from tessera.errors import InputError
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
MAX_FRAMES_PER_VIDEO = 8
"""Frames of the profiling video at most (vLLM caps them too): few, so that the profile run stays
cheap and fits small KV caches; real checkpoints are bounded by the sequence length first."""


class Qwen2VLProcessingInfo(BaseProcessingInfo):
    def get_hf_config(self) -> Qwen2VLConfig:
        return self.ctx.get_hf_config(Qwen2VLConfig)

    def get_hf_processor(self, **kwargs: object) -> Qwen2VLProcessor:
        return self.ctx.get_hf_processor(Qwen2VLProcessor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": None, "video": None}

    def _pixel_bounds(self, sub_processor: Any) -> tuple[int, int]:
        """(min_pixels, max_pixels) an image or video processor resizes to, as HF's call takes them: the
        model's mm_processor_kwargs `min_pixels` / `max_pixels` over their `size`, over the processor's own
        size (flat keys also built the processor; keys under ``images_kwargs`` / ``videos_kwargs`` did not)."""
        settings = self.ctx.get_call_settings(("min_pixels", "max_pixels", "size"), {})
        size = settings["size"] or getattr(sub_processor, "size", None) or {}
        get = size.get if isinstance(size, Mapping) else lambda key: getattr(size, key, None)
        return settings["min_pixels"] or get("shortest_edge"), settings["max_pixels"] or get("longest_edge")

    def _resize_params(self) -> tuple[int, int, int, int]:
        """(patch_size, merge_size, min_pixels, max_pixels) of the image processor."""
        image_processor = self.get_hf_processor().image_processor
        return image_processor.patch_size, image_processor.merge_size, *self._pixel_bounds(image_processor)

    def _video_params(self) -> tuple[int, int, int, int, int]:
        """(patch_size, merge_size, temporal_patch_size, min_pixels, max_pixels) of the video processor."""
        video_processor = self.get_hf_processor().video_processor
        return (
            video_processor.patch_size, video_processor.merge_size, video_processor.temporal_patch_size,
            *self._pixel_bounds(video_processor),
        )  # fmt: skip

    def get_num_video_tokens(self, *, image_width: int, image_height: int, num_frames: int) -> int:
        patch, merge, temporal, min_pixels, max_pixels = self._video_params()
        height, width = smart_resize(image_height, image_width, patch * merge, min_pixels, max_pixels)
        grid_t = -(-max(num_frames, 1) // temporal)
        return grid_t * (height // patch) * (width // patch) // merge**2

    def _get_max_video_frames(self, max_tokens: int) -> int:
        """The most frames of the largest size whose video stays within `max_tokens` (vLLM's rule;
        at most the video processor's max_frames)."""
        width, height = self.get_image_size_with_most_features()
        temporal = self._video_params()[2]
        per_patch = self.get_num_video_tokens(image_width=width, image_height=height, num_frames=temporal)
        max_frames = getattr(self.get_hf_processor().video_processor, "max_frames", None) or 768
        return min(max(max_tokens, 0) // per_patch * temporal, max_frames)

    def get_num_frames_with_most_features(self, seq_len: int, mm_counts: Mapping[str, int]) -> int:
        """Frames of each profiling video (vLLM's rule): what the sequence leaves after the images,
        shared by the videos, at most MAX_FRAMES_PER_VIDEO; whole temporal patches, at least one."""
        temporal = self._video_params()[2]
        max_images, max_videos = mm_counts.get("image", 0), mm_counts.get("video", 0)
        max_total_frames = self._get_max_video_frames(seq_len - self.get_max_image_tokens() * max_images)
        num_frames = min(max_total_frames // max(max_videos, 1), MAX_FRAMES_PER_VIDEO)
        return max(num_frames // temporal * temporal, temporal)

    def get_max_video_tokens(self, seq_len: int, mm_counts: Mapping[str, int]) -> int:
        width, height = self.get_image_size_with_most_features()
        num_frames = self.get_num_frames_with_most_features(seq_len, mm_counts)
        return self.get_num_video_tokens(image_width=width, image_height=height, num_frames=num_frames)

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
        return {"image": self.get_max_image_tokens(), "video": self.get_max_video_tokens(seq_len, mm_counts)}


class Qwen2VLDummyInputsBuilder(BaseDummyInputsBuilder[Qwen2VLProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        processor = self.info.get_hf_processor()  # as vLLM: pads alone
        return processor.image_token * mm_counts.get("image", 0) + processor.video_token * mm_counts.get("video", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        """Black images and videos of the largest size (videos: as many frames as vLLM's rule gives)."""
        width, height = self.info.get_image_size_with_most_features()
        data: dict[str, object] = {}
        if mm_counts.get("image", 0):
            data["image"] = self._get_dummy_images(width=width, height=height, num_images=mm_counts["image"])
        if mm_counts.get("video", 0):
            num_frames = self.info.get_num_frames_with_most_features(seq_len, mm_counts)
            video = np.zeros((num_frames, height, width, 3), dtype=np.uint8)
            data["video"] = [video] * mm_counts["video"]
        return data


class Qwen2VLMultiModalProcessor(BaseMultiModalProcessor[Qwen2VLProcessingInfo]):
    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        image_grid_thw = hf_inputs.get("image_grid_thw", torch.empty((0, 3)))
        video_grid_thw = hf_inputs.get("video_grid_thw", torch.empty((0, 3)))
        fields = {}
        if "image_embeds" in hf_inputs:  # precomputed, with each image's grid: its rows per image
            merge = self.info.get_hf_config().vision_config.spatial_merge_size
            rows = torch.as_tensor(image_grid_thw).reshape(-1, 3).prod(-1) // merge**2
            if int(rows.sum()) != len(hf_inputs["image_embeds"]):
                raise InputError(f"image_embeds have {len(hf_inputs['image_embeds'])} rows but their image_grid_thw "
                                 f"give {rows.tolist()} (t * h * w / {merge}^2 each).")  # fmt: skip
            fields["image_embeds"] = MultiModalFieldConfig.flat_from_sizes("image", rows)
        return dict(
            **fields,
            pixel_values=MultiModalFieldConfig.flat_from_sizes("image", image_grid_thw.prod(-1)),
            image_grid_thw=MultiModalFieldConfig.batched("image"),
            pixel_values_videos=MultiModalFieldConfig.flat_from_sizes("video", video_grid_thw.prod(-1)),
            video_grid_thw=MultiModalFieldConfig.batched("video"),
        )

    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """Videos: the frames as given (transformers' Qwen2-VL video processor samples none by
        default; said explicitly, as vLLM does, unless the caller's kwargs choose)."""
        if "videos" not in mm_data or "do_sample_frames" in self.info.ctx.get_merged_mm_kwargs(mm_kwargs):
            return super()._call_hf_processor(prompt, mm_data, mm_kwargs)
        return super()._call_hf_processor(prompt, {**mm_data, "do_sample_frames": False}, mm_kwargs)

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        hf_config = self.info.get_hf_config()
        merge_size = hf_config.vision_config.spatial_merge_size

        def replacement_for(modality: str, token_id: int):
            items = out_mm_kwargs.get_items(modality) if out_mm_kwargs.get_item_count(modality) else []

            def get_replacement(item_idx: int) -> list[int]:
                grid_thw = items[item_idx][f"{modality}_grid_thw"].data
                return [token_id] * (int(grid_thw.prod()) // merge_size**2)

            return PromptReplacement(modality=modality, target=[token_id], replacement=get_replacement)

        return [
            replacement_for("image", hf_config.image_token_id),
            replacement_for("video", hf_config.video_token_id),
        ]


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
        if modality == "image":
            return "<|vision_start|><|image_pad|><|vision_end|>"
        if modality == "video":
            return "<|vision_start|><|video_pad|><|vision_end|>"
        return None

    vision_tower_cls: type[nn.Module] = Qwen2VisionTransformer

    def __init__(self, config: Qwen2VLConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = self.vision_tower_cls(config.vision_config)
        self.language_model = ModelRegistry.build_language_model(config)
        self.placeholder_token_id = [config.image_token_id, config.video_token_id]
        self.spatial_merge_size = config.vision_config.spatial_merge_size

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        """One [t * h * w / merge**2, hidden] tensor per image, then per video (the engine passes
        one modality per call, so the items come back in the order given)."""
        embeddings = []
        if kwargs.get("image_embeds") is not None:  # precomputed: each image's rows, as its grid sizes them
            grids = torch.as_tensor(_stacked(kwargs["image_grid_thw"])).reshape(-1, 3)
            embeds = kwargs["image_embeds"]
            embeds = torch.cat(list(embeds)) if isinstance(embeds, (list, tuple)) else embeds
            return list(embeds.split((grids.prod(-1) // self.spatial_merge_size**2).tolist()))
        for pixels_key, grid_key in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
            if kwargs.get(pixels_key) is not None:
                embeddings += self._embed_vision(kwargs[pixels_key], kwargs.get(grid_key), pixels_key, grid_key)
        return embeddings or None

    def _embed_vision(self, pixel_values: Any, grid_thw: Any, pixels_key: str, grid_key: str) -> list[torch.Tensor]:
        """The vision tower on flat patches [num_patches, patch_dim] of items whose grids are `grid_thw`."""
        if isinstance(pixel_values, (list, tuple)):
            pixel_values = torch.cat(list(pixel_values))
        if isinstance(grid_thw, (list, tuple)):
            grid_thw = torch.stack([torch.as_tensor(g).reshape(3) for g in grid_thw])
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 2 or grid_thw is None:
            raise ValueError(f"{pixels_key} must be a (num_patches, patch_dim) tensor, with {grid_key}")
        grid_thw = torch.as_tensor(grid_thw).reshape(-1, 3)
        dtype, device = module_dtype_device(self.visual)
        embeds = self._run_vision_tower(pixel_values.to(device=device, dtype=dtype), grid_thw)
        sizes = (grid_thw.prod(-1) // self.spatial_merge_size**2).tolist()
        return list(embeds.split(sizes))

    def _run_vision_tower(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[N, patch_dim] patches of items with grids grid_thw [n, 3] -> [N / merge**2, embedding dim]."""
        return self.visual(pixel_values, grid_thw)

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: Sequence[Any]
    ) -> tuple[torch.Tensor, int]:
        """Each image's and video's grid placed at its first embedding token (mrope_positions.py);
        Qwen2-VL steps video frames by 1 (transformers' get_rope_index: time_interval 1)."""
        grids = []
        for feature in mm_features:
            if feature.modality not in ("image", "video"):
                raise ValueError(f"Qwen2-VL takes images and videos; got a {feature.modality}")
            position = feature.mm_position
            offset = position.offset
            if position.is_embed is not None:
                offset += int(torch.as_tensor(position.is_embed).nonzero()[0, 0])
            grid = feature.data[f"{feature.modality}_grid_thw"].data
            grid_thw = tuple(int(x) for x in torch.as_tensor(grid).reshape(3))
            grids.append(VisionGrid(offset, grid_thw, self._time_interval(feature)))
        return mrope_input_positions(len(input_tokens), grids, self.spatial_merge_size)

    def _time_interval(self, feature: Any) -> float:
        """Temporal M-RoPE step per grid frame of an image or video: 1 for Qwen2-VL."""
        return 1.0

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden]; positions [3, T] (M-RoPE)."""
        return self.language_model(input_ids, positions, inputs_embeds)


def _stacked(value: Any) -> Any:
    """A batched field as one tensor (the engine may pass a list of per-item tensors)."""
    if isinstance(value, (list, tuple)):
        return torch.stack([torch.as_tensor(v) for v in value])
    return value
