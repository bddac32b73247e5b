"""LLaVA-OneVision: a SigLIP tower, LLaVA's projector and (Qwen2) language model, images as LLaVA-NeXT's
anyres tiles and videos as pooled frames. Processing as in vLLM's llava_onevision.py.

Images: LLaVA-NeXT's tiles, unpadding and row newlines (llava_next.py), and "anyres_max_N"
(`vision_aspect_ratio`): an unpadded feature grid larger than N tiles' worth by more than 10% is shrunk
(bilinear) by the square root of the excess before the newlines go in. The HF processor counts the
tokens likewise (its _get_number_of_features). Each image is tiled as a prompt's only image is (our
processor passes the images as one flat list, as the HF processor treats such a list); HF's multi-image
mode, base tile only, is for images given as nested per-prompt lists, which prompts here never are.

Videos: every frame resized to the tower's size and run through it; each frame's feature grid is
halved (rounded up) by bilinear interpolation, the frames laid one after another and one
`image_newline` appended at the end: frames * ceil(side / 2)**2 + 1 tokens for a `<video>`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from transformers import BatchFeature, LlavaOnevisionConfig, LlavaOnevisionProcessor

from tessera.models.interfaces import MultiModalEmbeddings
from tessera.models.llava_next import (
    LlavaNextForConditionalGeneration,
    LlavaNextMultiModalProcessor,
    LlavaNextProcessingInfo,
    _as_list,
    best_resolution,
    max_patches_ratio,
    unpadded_shape,
)
from tessera.models.utils import module_dtype_device
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargs
from tessera.multimodal.parse import (
    ImageSize,
    MultiModalDataItems,
    VideoProcessorItems,
)
from tessera.multimodal.processing import PromptReplacement, PromptUpdate
from tessera.multimodal.profiling import BaseDummyInputsBuilder

MAX_FRAMES_PER_VIDEO = 8
"""Frames of the profiling video at most (vLLM caps them too): few, so that the profile run stays cheap."""


class LlavaOnevisionProcessingInfo(LlavaNextProcessingInfo):
    def get_hf_config(self) -> LlavaOnevisionConfig:
        return self.ctx.get_hf_config(LlavaOnevisionConfig)

    def get_hf_processor(self, **kwargs: object) -> LlavaOnevisionProcessor:
        return self.ctx.get_hf_processor(LlavaOnevisionProcessor, **kwargs)

    def get_supported_mm_limits(self) -> Mapping[str, Optional[int]]:
        return {"image": None, "video": None}

    def _tile_side(self) -> int:
        """Feature rows (= columns) of a tile: the processor's sqrt(num_image_tokens)."""
        return math.isqrt(self.get_hf_processor().num_image_tokens)

    def get_num_image_tokens(self, *, image_width: int, image_height: int) -> int:
        processor = self.get_hf_processor()
        tile_height, tile_width = self.get_tile_size()
        side = self._tile_side()
        best_height, best_width = best_resolution(image_height, image_width, self.get_grid_pinpoints())
        rows, columns = side * (best_height // tile_height), side * (best_width // tile_width)
        top, bottom, left, right = unpadded_shape(image_height, image_width, rows, columns)
        rows, columns = bottom - top, right - left
        ratio = max_patches_ratio(processor.vision_aspect_ratio, rows, columns, side)
        if ratio is not None:
            rows, columns = int(rows // ratio), int(columns // ratio)
        num_tokens = processor.num_image_tokens + rows * columns + rows
        return num_tokens - (processor.vision_feature_select_strategy == "default")

    def get_image_size_with_most_features(self) -> ImageSize:
        """The size whose image gets the most tokens. Not always a grid pinpoint, as for LLaVA-NeXT (and
        vLLM): a pinpoint's full grid may be shrunk by anyres_max_N where a slightly padded one, under the
        10% margin, is not. So every grid's unpadded shapes are tried: images as wide as the pinpoint and
        1..rows feature rows high, and as high and 1..columns wide."""
        if getattr(self, "_most_features", None) is None:
            tile_height, tile_width = self.get_tile_size()
            side = self._tile_side()
            candidates = []
            for height, width in self.get_grid_pinpoints():
                rows, columns = side * (height // tile_height), side * (width // tile_width)
                candidates += [(width, max(1, round(height * k / rows))) for k in range(1, rows + 1)]
                candidates += [(max(1, round(width * k / columns)), height) for k in range(1, columns + 1)]
            best = max(
                (self.get_num_image_tokens(image_width=w, image_height=h), -w * h, w, h) for w, h in set(candidates)
            )
            self._most_features = ImageSize(width=best[2], height=best[3])
        return self._most_features

    def get_num_video_tokens(self, *, image_width: int, image_height: int, num_frames: int) -> int:
        """Frames of any size are resized to the tower's: ceil(side / 2)**2 tokens each, one newline."""
        pooled = math.ceil(self._tile_side() / 2)
        return num_frames * pooled**2 + 1

    def get_num_frames_with_most_features(self, seq_len: int, mm_counts: Mapping[str, int]) -> int:
        """Frames of each profiling video (vLLM's rule): what the sequence leaves after the images,
        shared by the videos, at most MAX_FRAMES_PER_VIDEO, at least one."""
        max_images, max_videos = mm_counts.get("image", 0), mm_counts.get("video", 0)
        left = seq_len - self.get_max_image_tokens() * max_images
        per_frame = math.ceil(self._tile_side() / 2) ** 2
        max_total_frames = max(left - max(max_videos, 1), 0) // per_frame
        return max(min(max_total_frames // max(max_videos, 1), MAX_FRAMES_PER_VIDEO), 1)

    def get_max_video_tokens(self, seq_len: int, mm_counts: Mapping[str, int]) -> int:
        size = self.get_hf_config().vision_config.image_size
        num_frames = self.get_num_frames_with_most_features(seq_len, mm_counts)
        return self.get_num_video_tokens(image_width=size, image_height=size, num_frames=num_frames)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        return {"image": self.get_max_image_tokens(), "video": self.get_max_video_tokens(seq_len, mm_counts)}


class LlavaOnevisionDummyInputsBuilder(BaseDummyInputsBuilder[LlavaOnevisionProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        processor = self.info.get_hf_processor()
        return processor.image_token * mm_counts.get("image", 0) + processor.video_token * mm_counts.get("video", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]):
        width, height = self.info.get_image_size_with_most_features()
        data: dict[str, object] = {}
        if mm_counts.get("image", 0):
            data["image"] = self._get_dummy_images(width=width, height=height, num_images=mm_counts["image"])
        if mm_counts.get("video", 0):
            size = self.info.get_hf_config().vision_config.image_size
            num_frames = self.info.get_num_frames_with_most_features(seq_len, mm_counts)
            data["video"] = [np.zeros((num_frames, size, size, 3), dtype=np.uint8)] * mm_counts["video"]
        return data


class LlavaOnevisionMultiModalProcessor(LlavaNextMultiModalProcessor):
    """LLaVA-NeXT's images; videos as `video_token_index` repeated get_num_video_tokens times."""

    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """Images: each its own tiles (llava_next.split_padded_tiles); videos: one [frames, C, H, W]
        tensor each, the frames as given (do_sample_frames=False unless the caller's kwargs choose)."""
        if "videos" in mm_data and "do_sample_frames" not in self.info.ctx.get_merged_mm_kwargs(mm_kwargs):
            mm_data = {**mm_data, "do_sample_frames": False}
        processed = super()._call_hf_processor(prompt, mm_data, mm_kwargs)
        processed.pop("batch_num_images", None)
        if processed.get("pixel_values_videos") is not None:
            processed["pixel_values_videos"] = list(processed["pixel_values_videos"])
        return processed

    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return dict(
            super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs),
            pixel_values_videos=MultiModalFieldConfig.batched("video"),
        )

    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        video_token_id = self.info.get_hf_config().video_token_index

        def video_replacement(item_idx: int) -> list[int]:
            videos = mm_items.get_items("video", VideoProcessorItems)
            size = videos.get_frame_size(item_idx)
            num_tokens = self.info.get_num_video_tokens(
                image_width=size.width, image_height=size.height, num_frames=videos.get_num_frames(item_idx)
            )
            return [video_token_id] * num_tokens

        return [
            *super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs),
            PromptReplacement(modality="video", target=[video_token_id], replacement=video_replacement),
        ]


@MULTIMODAL_REGISTRY.register_processor(
    LlavaOnevisionMultiModalProcessor, info=LlavaOnevisionProcessingInfo, dummy_inputs=LlavaOnevisionDummyInputsBuilder
)
class LlavaOnevisionForConditionalGeneration(LlavaNextForConditionalGeneration):
    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> Optional[str]:
        return {"image": "<image>", "video": "<video>"}.get(modality)

    def __init__(self, config: LlavaOnevisionConfig) -> None:
        super().__init__(config)
        self.vision_aspect_ratio = config.vision_aspect_ratio
        self.placeholder_token_id = [config.image_token_index, config.video_token_index]

    def _video_embeddings(self, pixel_values_videos: Any) -> list[torch.Tensor]:
        """Each video's frames [frames, C, H, W] -> [frames * ceil(side / 2)**2 + 1, hidden]."""
        videos = _as_list(pixel_values_videos, "pixel_values_videos")
        if any(v.ndim != 4 for v in videos):
            raise ValueError("pixel_values_videos must hold one (frames, channels, height, width) tensor per video")
        features = self._tile_features(torch.cat(videos))  # [all frames, side * side, hidden]
        side = self.tile_side
        grid = features.reshape(features.shape[0], side, side, -1).permute(0, 3, 1, 2)
        dtype, _ = module_dtype_device(self.multi_modal_projector)
        pooled = nn.functional.interpolate(grid, size=[math.ceil(side / 2)] * 2, mode="bilinear")
        pooled = pooled.permute(0, 2, 3, 1).flatten(1, 2).to(dtype)  # [frames, pooled tokens, hidden]
        newline = self.image_newline[None].to(pooled)
        return [
            torch.cat((frames.flatten(0, 1), newline))
            for frames in pooled.split([v.shape[0] for v in videos])
        ]  # fmt: skip

    def get_multimodal_embeddings(self, **kwargs: object) -> Optional[MultiModalEmbeddings]:
        """One tensor per image, then per video (the engine passes one modality per call)."""
        embeddings = list(super().get_multimodal_embeddings(**kwargs) or [])
        if kwargs.get("pixel_values_videos") is not None:
            embeddings += self._video_embeddings(kwargs["pixel_values_videos"])
        return embeddings or None
