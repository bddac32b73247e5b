"""Routed experts (mixture of experts): each token goes to the top-k experts its router scores highest, and only
those experts run.

Tokens are grouped by expert (one sort of the [T * k] choices), so each expert that got any token runs one
gated-MLP matmul pair over its group; an expert with no token is never touched, which on a CPU means its
weights are never read: decode streams only the routed experts. Weights keep transformers' in-memory layout,
`gate_up_proj` [E, 2I, H] (the gate's rows first) and `down_proj` [E, H, I]; checkpoints may also hold them
transposed ([E, H, 2I] / [E, I, H], Qwen3-VL-MoE's released files) or one expert at a time
(`experts.{j}.gate_proj.weight`, Qwen3.5-MoE's), which the loader fits in (`checkpoint_parts`,
`adapt_checkpoint_tensor`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed import get_tp_group
from .activations import get_activation


def softmax_top_k(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]): softmax over all experts in float32, the k largest, divided by
    their sum when `renormalize` (Qwen3-MoE, Qwen3.5-MoE, Gemma 4)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 activation: str = "silu") -> None:  # fmt: skip
        super().__init__()
        if get_tp_group().world_size > 1:
            raise ValueError(
                "Routed-expert layers do not split over tensor-parallel ranks yet; use tensor_parallel_size=1."
            )
        self.num_experts, self.top_k, self.intermediate_size = num_experts, top_k, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = get_activation(activation)
        self.experts_run = 0
        """Expert MLPs run so far (each expert counted once per forward in which it got a token)."""

    def forward(self, hidden_states: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H]; weights, expert_ids [T, k] (the router's choice) -> [T, H]."""
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k  # the token of each choice, grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        scale = weights.reshape(-1)[order].to(hidden_states.dtype)[:, None]
        out = torch.zeros_like(hidden_states)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            gate, up = (hidden_states[rows] @ self.gate_up_proj[expert].T).chunk(2, dim=-1)
            out.index_add_(0, rows, (self.act(gate) * up) @ self.down_proj[expert].T * scale[start : start + count])
            start += count
            self.experts_run += 1
        return out

    def checkpoint_parts(self) -> dict[str, tuple[str, Any]]:
        """Checkpoint names (below this module) of one expert's projections -> (parameter, its index there)."""
        size, parts = self.intermediate_size, {}
        for j in range(self.num_experts):
            parts[f"{j}.gate_proj.weight"] = ("gate_up_proj", (j, slice(0, size)))
            parts[f"{j}.up_proj.weight"] = ("gate_up_proj", (j, slice(size, 2 * size)))
            parts[f"{j}.down_proj.weight"] = ("down_proj", j)
        return parts

    def adapt_checkpoint_tensor(self, param: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """A whole expert tensor stored transposed ([E, in, out], the bmm layout) as this layer holds it."""
        transposed = (shape[0], shape[2], shape[1])
        if tensor.ndim == 3 and tuple(tensor.shape) != tuple(shape) and tuple(tensor.shape) == transposed:
            return tensor.transpose(1, 2)
        return tensor
