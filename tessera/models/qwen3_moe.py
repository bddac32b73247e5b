"""Qwen3-MoE (`Qwen3MoeForCausalLM`, e.g. Qwen3-30B-A3B): Qwen3's decoder (qwen3.py) with routed experts in its
MLPs (qwen_moe.py: no shared expert; `norm_topk_prob` says whether the top-k weights are renormalised)."""

from __future__ import annotations

from typing import Any

from tessera.models.causal_lm import CausalLM
from tessera.models.qwen3 import Qwen3Model
from tessera.models.qwen_moe import use_sparse_mlps


class Qwen3MoeModel(Qwen3Model):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        use_sparse_mlps(self.layers, config)


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config, Qwen3MoeModel(config))
