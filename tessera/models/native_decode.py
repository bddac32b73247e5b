"""Decode steps of Llama-shaped layers as one native call per layer (`csrc/decode_layer.cpp`).

A decode step of a 135M model spends more time in eager PyTorch's per-op cost (Python, module calls, dispatch:
~400 us a layer) than in reading its weights. `NativeDecodeLayer` calls the linears' native kernels directly
from C++ and computes RMSNorm, rotary, the cache write and attention over the cache's blocks in one pass each,
with the eager modules' roundings (16-bit values rounded where they round), so only the order of float32 sums
differs (tests/models/test_native_decode.py): one call per layer instead of ~40 torch ops.

Which layers: `LlamaDecoderLayer` (Llama, Mistral, Qwen2 with its q/k/v biases, Qwen3 with its q/k norms, and
the VLMs built on them) and `Gemma3DecoderLayer` (its (1 + w) norms, also after the attention and the MLP), on
CPU, with silu or tanh-gelu MLPs and no soft-capping, whose linears each run a kernel
the native layer can call (`Linear.native_decode_weight`). A layer names its norms' roles in `NATIVE_NORMS`.
Which steps: pure decode steps (one new token per sequence, any number of sequences); prefill and mixed steps
stay eager. Under tensor parallelism a layer is three native calls, the o and down outputs summed over the ranks
between them (as RowParallelLinear sums them in the eager layer). `TESSERA_CPU_KERNELS=fallback` turns it off
with the other native kernels.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from ..layers import native_kernels
from ..layers.attention import get_attention_metadata
from ..layers.cpu_kernels import kernel_mode
from ..layers.layernorm import RMSNorm
from ..layers.linear import Linear, RowParallelLinear
from ..layers.lora import lora_active

logger = logging.getLogger(__name__)

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}
"""MLP activations the native layer computes (as `activations.ACTIVATIONS` does), by config name."""


class NativeDecodeLayer:
    """The native decode layer of one `LlamaDecoderLayer` (`build` says whether it can have one)."""

    def __init__(self, layer: nn.Module, native: torch.ScriptObject, dtype: torch.dtype) -> None:
        self.attn, self.rope, self.native = layer.self_attn.attn, layer.self_attn.rotary_emb, native
        tp = layer.self_attn.o_proj.tp if isinstance(layer.self_attn.o_proj, RowParallelLinear) else None
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        """The tensor-parallel group whose ranks' o and down outputs are summed between the native parts."""
        self.dtype = dtype
        """The hidden states' dtype it runs (its norms' weights'); others run the eager layer."""

    @classmethod
    def build(cls, layer: nn.Module, activation: str) -> Optional[NativeDecodeLayer]:
        """The native layer for `layer` (its weights as they are now: built after loading and packing), or None
        where it cannot run it."""
        attn = layer.self_attn
        linears = {
            "qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj
        }
        norms = {role: getattr(layer, name) for role, name in layer.NATIVE_NORMS.items()}
        if attn.q_norm is not None:
            norms.update(q=attn.q_norm, k=attn.k_norm)
        if (
            kernel_mode() == "fallback"
            or not native_kernels.available()
            or activation not in ACTIVATIONS
            or attn.attn.logits_soft_cap is not None
            or any(_unit_offset(n) is None for n in norms.values())
            or len({n.weight.dtype for n in norms.values()}) != 1
            or any(p.device.type != "cpu" for p in layer.parameters())
        ):
            return None
        weights = {name: m.native_decode_weight() if isinstance(m, Linear) else None for name, m in linears.items()}
        if any(w is None for w in weights.values()):
            return None
        native = torch.classes.tessera.DecodeLayer(
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scale, ACTIVATIONS[activation],
            native_kernels.cpu_isa(),
        )
        for name, norm in norms.items():
            native.set_norm(name, norm.weight.detach(), norm.eps, _unit_offset(norm))
        for name, (kind, weight, scales, isa) in weights.items():
            module = linears[name]
            bias = None if module.bias is None else module.bias.detach()
            native.set_linear(name, int(kind), weight.detach(), scales, bias, module.out_features, isa,
                              module.qzero_point)  # fmt: skip
        return cls(layer, native, layer.input_layernorm.weight.dtype)

    def __call__(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions [B], hidden [B, hidden] of a pure decode step -> the layer's output [B, hidden]."""
        metadata = get_attention_metadata()
        window = self.attn.sliding_window
        tables, mask = metadata.decode_tables(window)
        cos, sin = self.rope.tables(positions, hidden_states.dtype)
        inputs = (hidden_states, cos, sin, self.attn.k_cache, self.attn.v_cache, metadata.slot_mapping, tables, mask)
        if self.tp is None:
            return self.native.forward(*inputs)
        # tensor parallelism: the all-reduces of the eager layer's RowParallelLinears, between the native parts
        hidden, down = self.native.mlp(hidden_states, self.tp.all_reduce(self.native.attention(*inputs)))
        return self.native.finish(hidden, self.tp.all_reduce(down))


def _unit_offset(norm: nn.Module) -> Optional[bool]:
    """How the native layer computes `norm`: False as `RMSNorm` (x * r rounded, times w), True as a norm of
    (1 + w) in float32 (Gemma 3's, whose class says `unit_offset = True`), None: it does not."""
    if type(norm) is RMSNorm:
        return False
    return True if getattr(type(norm), "unit_offset", False) else None


def native_layer_for_step(layer: nn.Module, hidden_states: torch.Tensor) -> Optional[NativeDecodeLayer]:
    """The native decode layer that runs `layer` on this step (built on the first decode step, kept in
    `layer._native`; False there once it cannot), or None: the step runs the eager modules."""
    if layer._native is False or not is_decode_step(hidden_states) or lora_active():  # adapters: eager modules
        return None
    if layer._native is None:
        layer._native = NativeDecodeLayer.build(layer, layer.mlp.activation) or False
    return layer._native if layer._native and layer._native.dtype == hidden_states.dtype else None


def is_decode_step(hidden_states: torch.Tensor) -> bool:
    """Whether the step's every token is a decode token (one new token per sequence)."""
    return len(get_attention_metadata().decode_rows) == hidden_states.shape[0]
