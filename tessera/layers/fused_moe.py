"""Routed experts (mixture of experts): each token goes to the top-k experts its router scores highest, and only
those experts run.

Tokens are grouped by expert (one sort of the [T * k] choices), so each expert that got any token runs one
gated-MLP matmul pair over its group; an expert with no token is never touched, which on a CPU means its
weights are never read: decode streams only the routed experts.

Loading: the weights keep transformers' in-memory layout, `gate_up_proj` [E, 2I, H] (the gate's rows first) and
`down_proj` [E, H, I]; checkpoints may also hold them transposed ([E, H, 2I] / [E, I, H], Qwen3-VL-MoE's released
files) or one expert at a time (`experts.{j}.gate_proj.weight`, Qwen3.5-MoE's), which the loader fits in
(`checkpoint_parts`, `adapt_checkpoint_tensor`). Tensor parallelism splits each expert's intermediate size I
over the ranks (`shard_weight`: the rank's gate, up and down slices); the partial outputs are summed once per
layer.

Running: once loaded, `split_experts()` turns each expert into two `Linear` layers (`gate_up[j]`, `down[j]`,
views of the loaded tensors), so every kernel a Linear has serves the experts as it serves the rest of the
model: the native GEMV and oneDNN packing (`pack_linears_for_cpu`), int8/int4 weight-only quantization
(`quantize_linears`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..distributed import divide, get_tp_group
from .activations import get_activation
from .linear import Linear


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


def sigmoid_top_k(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool = True,
    correction_bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) of sigmoid scoring (DeepSeek-V3, GLM-4.5 routers): each expert's
    score is sigmoid(logit) on its own; `correction_bias` [E] (e_score_correction_bias) shifts which experts are
    chosen but not their weights; the chosen scores divided by their sum when `renormalize`."""
    scores = torch.sigmoid(router_logits.float())
    choice = scores if correction_bias is None else scores + correction_bias.float()
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 activation: str = "silu") -> None:  # fmt: skip
        super().__init__()
        self.tp = get_tp_group()
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = divide(intermediate_size, self.tp.world_size, "moe_intermediate_size")  # this rank's
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_size))
        self.act = get_activation(activation)
        self.gate_up: nn.ModuleList = nn.ModuleList()  # per expert, once split (split_experts)
        self.down: nn.ModuleList = nn.ModuleList()
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
            out.index_add_(0, rows, self.expert_mlp(expert, hidden_states[rows]) * scale[start : start + count])
            start += count
            self.experts_run += 1
        return self.tp.all_reduce(out)  # each rank summed its slice of every expert's intermediate channels

    def expert_mlp(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """One expert's gated MLP (this rank's slice of it) on x [n, H] -> [n, H]."""
        if len(self.gate_up):
            gate, up = self.gate_up[expert](x).chunk(2, dim=-1)
            return self.down[expert](self.act(gate) * up)
        gate, up = (x @ self.gate_up_proj[expert].T).chunk(2, dim=-1)
        return (self.act(gate) * up) @ self.down_proj[expert].T

    def split_experts(self) -> None:
        """Each expert as two `Linear` layers over views of the loaded weights, which are then dropped from this
        module (the views keep them until a kernel repacks or quantizes each layer and frees its copy)."""
        if len(self.gate_up) or self.gate_up_proj.device.type == "meta":
            return
        size, hidden = self.intermediate_size, self.hidden_size
        for j in range(self.num_experts):
            for layers, weight, shape in ((self.gate_up, self.gate_up_proj, (hidden, 2 * size)),
                                          (self.down, self.down_proj, (size, hidden))):  # fmt: skip
                with torch.device("meta"):
                    layer = Linear(*shape, bias=False)
                layer.weight = nn.Parameter(weight.data[j], requires_grad=False)
                layers.append(layer)
        empty = torch.empty(0, dtype=self.gate_up_proj.dtype, device=self.gate_up_proj.device)
        self.gate_up_proj = nn.Parameter(empty, requires_grad=False)
        self.down_proj = nn.Parameter(empty.clone(), requires_grad=False)

    def shard_weight(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor (whole [E, 2I, H] / [E, H, I], or one expert's gate or up [I, H] / down [H, I]) ->
        this rank's slice of the intermediate channels (of the gate and of the up half each)."""
        world, rank = self.tp.world_size, self.tp.rank
        if param == "down_proj":
            return tensor.chunk(world, dim=-1)[rank]
        if tensor.ndim == 2:  # one expert's gate or up
            return tensor.chunk(world, dim=0)[rank]
        gate, up = tensor.chunk(2, dim=1)
        return torch.cat((gate.chunk(world, dim=1)[rank], up.chunk(world, dim=1)[rank]), dim=1)

    def checkpoint_parts(self) -> dict[str, tuple[str, Any]]:
        """Checkpoint names (below this module) of one expert's projections -> (parameter, its index there)."""
        size, parts = self.intermediate_size, {}
        for j in range(self.num_experts):
            parts[f"{j}.gate_proj.weight"] = ("gate_up_proj", (j, slice(0, size)))
            parts[f"{j}.up_proj.weight"] = ("gate_up_proj", (j, slice(size, 2 * size)))
            parts[f"{j}.down_proj.weight"] = ("down_proj", j)
        return parts

    def adapt_checkpoint_tensor(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """A whole expert tensor stored transposed ([E, in, out], the bmm layout) as transformers holds it (decided
        by the whole tensor's shape, before any tensor-parallel slicing, as HF decides)."""
        size, hidden = self.full_intermediate_size, self.hidden_size
        shape = (self.num_experts, 2 * size, hidden) if param == "gate_up_proj" else (self.num_experts, hidden, size)
        transposed = (shape[0], shape[2], shape[1])
        if tensor.ndim == 3 and tuple(tensor.shape) != shape and tuple(tensor.shape) == transposed:
            return tensor.transpose(1, 2)
        return tensor


def split_experts(model: nn.Module) -> int:
    """Split every routed-expert layer of `model` into per-expert Linears (`FusedMoE.split_experts`); how many."""
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    for layer in layers:
        layer.split_experts()
    return len(layers)
