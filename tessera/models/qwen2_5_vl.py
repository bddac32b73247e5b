"""Qwen2.5-VL: Qwen2-VL's processing and Qwen2 decoder with M-RoPE positions, a vision tower with window
attention (qwen2_5_vl_vision.py), and videos placed in time by their frame rate. As vLLM's qwen2_5_vl.py.

Processing is Qwen2-VL's; HF's Qwen2_5_VLProcessor also returns second_per_grid_ts, one value per
video (temporal_patch_size / fps: the seconds one grid frame spans), which M-RoPE turns into the
video's temporal step: time_interval = vision_config.tokens_per_second * second_per_grid_ts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import BatchFeature, Qwen2_5_VLConfig, Qwen2_5_VLProcessor

from tessera.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer
from tessera.models.qwen2_vl import (
    Qwen2VLDummyInputsBuilder,
    Qwen2VLForConditionalGeneration,
    Qwen2VLMultiModalProcessor,
    Qwen2VLProcessingInfo,
)
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.inputs import MultiModalFieldConfig


class Qwen2_5_VLProcessingInfo(Qwen2VLProcessingInfo):
    def get_hf_config(self) -> Qwen2_5_VLConfig:
        return self.ctx.get_hf_config(Qwen2_5_VLConfig)

    def get_hf_processor(self, **kwargs: object) -> Qwen2_5_VLProcessor:
        return self.ctx.get_hf_processor(Qwen2_5_VLProcessor, **kwargs)


class Qwen2_5_VLDummyInputsBuilder(Qwen2VLDummyInputsBuilder):
    pass


class Qwen2_5_VLMultiModalProcessor(Qwen2VLMultiModalProcessor):
    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        return dict(
            super()._get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs),
            second_per_grid_ts=MultiModalFieldConfig.batched("video"),
        )


@MULTIMODAL_REGISTRY.register_processor(
    Qwen2_5_VLMultiModalProcessor, info=Qwen2_5_VLProcessingInfo, dummy_inputs=Qwen2_5_VLDummyInputsBuilder
)
class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_tower_cls = Qwen2_5_VisionTransformer

    def _time_interval(self, feature: Any) -> float:
        """Videos: tokens_per_second * second_per_grid_ts, computed in float32 as transformers'
        get_rope_index does (its positions truncate t * interval); images: 1."""
        if feature.modality != "video" or "second_per_grid_ts" not in feature.data:
            return 1.0
        seconds = torch.as_tensor(feature.data["second_per_grid_ts"].data, dtype=torch.float32).reshape(())
        return float(self.config.vision_config.tokens_per_second * seconds)
