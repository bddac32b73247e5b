"""The Qwen family's sparse MLP (Qwen3-MoE, Qwen3-VL-MoE, Qwen3.5-MoE): a router (`gate`, no bias) whose softmax
top-k, renormalised, picks the routed experts (layers/fused_moe.py), and, where the model has one, a shared
expert every token goes through, scaled per token by sigmoid(`shared_expert_gate`). As transformers'
Qwen3VLMoeTextSparseMoeBlock and Qwen3_5MoeSparseMoeBlock."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.layers.fused_moe import FusedMoE, softmax_top_k
from tessera.models.llama import LlamaMLP


class QwenSparseMoeBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        # Qwen3-MoE says whether the top-k are renormalised; Qwen3-VL-MoE and Qwen3.5-MoE always do (no such field)
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config.num_experts, self.top_k, config.hidden_size, config.moe_intermediate_size,
                                config.hidden_act)  # fmt: skip
        shared_size = getattr(config, "shared_expert_intermediate_size", None)
        self.shared_expert = self.shared_expert_gate = None
        if shared_size:
            self.shared_expert = LlamaMLP(config, intermediate_size=shared_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, expert_ids = softmax_top_k(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights.to(x.dtype), expert_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def is_sparse_layer(config: Any, index: int) -> bool:
    """Whether decoder layer `index` has routed experts (Qwen3-MoE's rule: not in mlp_only_layers, every
    decoder_sparse_step-th layer; configs without those fields: every layer)."""
    if index in (getattr(config, "mlp_only_layers", None) or []):
        return False
    step = getattr(config, "decoder_sparse_step", None) or 1
    return getattr(config, "num_experts", 0) > 0 and (index + 1) % step == 0


def use_sparse_mlps(layers: nn.ModuleList, config: Any) -> None:
    """Give the decoder layers their sparse MLPs (`mlp`), as `is_sparse_layer` says."""
    for index, layer in enumerate(layers):
        if is_sparse_layer(config, index):
            layer.mlp = QwenSparseMoeBlock(config)
            layer._native = False  # the native decode layer fuses a dense MLP
