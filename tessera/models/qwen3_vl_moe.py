"""Qwen3-VL-MoE: Qwen3-VL (its vision tower, DeepStack, interleaved M-RoPE and processing, qwen3_vl.py) with
routed experts in the decoder's MLPs (qwen_moe.py). As transformers' modeling_qwen3_vl_moe.py."""

from __future__ import annotations

from typing import Any

from transformers import Qwen3VLMoeConfig

from tessera.models.causal_lm import CausalLM
from tessera.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
    Qwen3VLTextForCausalLM,
    Qwen3VLTextModel,
)
from tessera.models.qwen_moe import use_sparse_mlps
from tessera.multimodal import MULTIMODAL_REGISTRY


class Qwen3VLMoeTextModel(Qwen3VLTextModel):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        use_sparse_mlps(self.layers, config)


class Qwen3VLMoeTextForCausalLM(Qwen3VLTextForCausalLM):
    def __init__(self, config: Any) -> None:
        CausalLM.__init__(self, config, Qwen3VLMoeTextModel(config))


class Qwen3VLMoeProcessingInfo(Qwen3VLProcessingInfo):
    def get_hf_config(self) -> Qwen3VLMoeConfig:
        return self.ctx.get_hf_config(Qwen3VLMoeConfig)


@MULTIMODAL_REGISTRY.register_processor(
    Qwen3VLMultiModalProcessor, info=Qwen3VLMoeProcessingInfo, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL's model; its text config (`qwen3_vl_moe_text`) builds the decoder with routed experts."""
