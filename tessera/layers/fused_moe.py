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

from typing import Any, Optional

import torch
from torch import nn

from ..distributed import get_tp_group
from . import native_kernels
from .activations import get_activation
from .cpu_kernels import NATIVE, linear_kernel


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
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = get_activation(activation)
        self.experts_run = 0
        """Expert MLPs run so far (each expert counted once per forward in which it got a token)."""
        self.native: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]] = None
        """Each expert's gate_up and down weights as Tessera's native GEMV streams them, once packed."""

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
            out.index_add_(0, rows, self.expert_mlp(expert, hidden_states[rows]) * scale[start : start + count])
            start += count
            self.experts_run += 1
        return out

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's gated MLP on x [n, H] -> [n, H]."""
        size = self.intermediate_size
        if self.native is not None:
            gate_up, down = self.native
            gate, up = native_kernels.linear(x, gate_up[expert], 2 * size).chunk(2, dim=-1)
            return native_kernels.linear(self.act(gate) * up, down[expert], self.hidden_size)
        gate, up = (x @ self.gate_up_proj[expert].T).chunk(2, dim=-1)
        return (self.act(gate) * up) @ self.down_proj[expert].T

    def pack_for_cpu(self, mode: Optional[str] = None) -> int:
        """Repack every expert for Tessera's native GEMV where `linear_kernel` picks it for this dtype (what
        pack_linears_for_cpu does for Linear layers), dropping the dense copies. Returns the weights packed."""
        weight = self.gate_up_proj
        if weight.device.type != "cpu" or weight.numel() == 0 or linear_kernel(weight.dtype, mode) != NATIVE:
            return 0
        self.native = ([native_kernels.pack(w) for w in self.gate_up_proj],
                       [native_kernels.pack(w) for w in self.down_proj])  # fmt: skip
        empty = torch.empty(0, dtype=weight.dtype)
        self.gate_up_proj = nn.Parameter(empty, requires_grad=False)
        self.down_proj = nn.Parameter(empty.clone(), requires_grad=False)
        return 2 * self.num_experts

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
