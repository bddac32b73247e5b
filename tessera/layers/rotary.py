"""Rotary position embeddings (the "rotate half" layout of Llama, Persimmon and most HF models)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RotaryEmbedding(nn.Module):
    """Rotates the first `rotary_dim` features of q and k by position-dependent angles.

    Frequencies come from transformers' rope initialisers, so every `rope_scaling` type with a
    fixed frequency table (default, linear, llama3, yarn, ...) matches HF; "dynamic" scaling,
    whose table changes with the sequence length, is refused.
    """

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        rope_scaling = getattr(config, "rope_scaling", None) or {}
        if "mrope_section" in rope_scaling:  # transformers renames "mrope" to "default": never run it as 1-D
            raise ValueError(
                f"The model config asks for M-RoPE (mrope_section {rope_scaling['mrope_section']}): three-axis "
                "positions this rotary embedding does not compute; this model cannot run that config."
            )
        self.rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if self.rope_type not in ROPE_INIT_FUNCTIONS or self.rope_type == "dynamic":
            raise ValueError(f"Unsupported rope_scaling type {self.rope_type!r} in the model config")
        self.config = config
        self.rotary_dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
        self._inv_freq: Optional[torch.Tensor] = None  # built on first use: the model may be created on "meta"
        self.attention_scaling = 1.0
        # Layers share one instance and one positions tensor per step: compute cos/sin once.
        self._cached: Optional[tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor]] = None

    def _frequencies(self, device: torch.device) -> torch.Tensor:
        if self._inv_freq is None or self._inv_freq.device != device:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, device)
            self._inv_freq = inv_freq.float()
        return self._inv_freq

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H, D], k [T, Hkv, D] -> rotated q, k (same shapes)."""
        cached = self._cached
        if cached is None or cached[0] is not positions or cached[1] != q.dtype:
            inv_freq = self._frequencies(q.device)
            freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim / 2]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * self.attention_scaling).to(q.dtype)[:, None, :]  # [T, 1, rotary_dim]
            sin = (emb.sin() * self.attention_scaling).to(q.dtype)[:, None, :]
            cached = self._cached = (positions, q.dtype, cos, sin)
        _, _, cos, sin = cached
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.numel() else rotated
