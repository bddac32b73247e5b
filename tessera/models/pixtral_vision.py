"""Pixtral's vision tower (Mistral 3.1, Pixtral): a patch convolution without bias, ln_pre (RMSNorm), and
pre-norm blocks (RMSNorm, attention with 2-D rotary embeddings, RMSNorm, gated MLP), no bias anywhere.
Module names mirror Hugging Face's `PixtralVisionModel`.

Images keep their aspect ratio: each is (height, width) pixels, multiples of patch_size after the
processor's resize, and becomes its own grid of (height / patch) x (width / patch) patches, flattened
row-major. A patch is rotated by its (row, column) in its image's grid: HF's "axial" rope takes the
frequencies of a head_dim rope, gives the even-indexed ones to the row and the odd-indexed ones to the
column (unlike the Qwen2-VL towers, which use one table for both axes). Every image attends only to its
own patches (block-diagonal attention), as HF's block mask does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tessera.layers.activations import get_activation
from tessera.layers.layernorm import RMSNorm
from tessera.layers.linear import Linear
from tessera.layers.vision_rotary import apply_rotary_pos_emb_vision

PIXTRAL_NORM_EPS = 1e-5  # HF's PixtralRMSNorm eps, fixed whatever the config says


def _rope_theta(config: PretrainedConfig) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "axial")
    if rope_type != "axial":
        raise ValueError(f"Pixtral's vision tower supports only axial rope, got rope_type {rope_type!r}")
    return float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


class PixtralRotaryEmbedding(nn.Module):
    """forward(grids) -> (cos, sin), each [N, head_dim] fp32, for the patches of images whose patch grids
    are `grids` [(rows, columns), ...], each image's patches row-major, the images one after the other."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"2-D rope needs head_dim divisible by 4 (two axes x cos/sin pairs), got {head_dim}")
        self.head_dim = head_dim
        self.theta = float(theta)
        # CPU explicitly: towers may be built under `with torch.device("meta")`; moved on use
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
        self._inv_freq = {torch.device("cpu"): (inv_freq[0::2], inv_freq[1::2])}  # rows, columns: [head_dim / 4]

    def inv_freq(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._inv_freq:
            self._inv_freq[device] = tuple(f.to(device) for f in self._inv_freq[torch.device("cpu")])
        return self._inv_freq[device]

    def forward(
        self, grids: Sequence[tuple[int, int]], device: Optional[torch.device] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = device or torch.device("cpu")
        row_freq, col_freq = self.inv_freq(device)
        angles = []
        for rows, cols in grids:
            r, c = torch.meshgrid(
                torch.arange(rows, device=device, dtype=torch.float),
                torch.arange(cols, device=device, dtype=torch.float),
                indexing="ij",
            )
            angles.append(torch.cat([r.flatten()[:, None] * row_freq, c.flatten()[:, None] * col_freq], dim=-1))
        emb = torch.cat(angles).repeat(1, 2)  # [N, head_dim]: both halves share an angle
        return emb.cos(), emb.sin()

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"


class PixtralAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = dim // self.num_heads
        self.q_proj = Linear(dim, dim, bias=False)
        self.k_proj = Linear(dim, dim, bias=False)
        self.v_proj = Linear(dim, dim, bias=False)
        self.o_proj = Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, dim]; every image attends to its own `lengths[i]` patches only (block-diagonal)."""
        n = x.shape[0]
        q = self.q_proj(x).reshape(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(n, self.num_heads, self.head_dim)
        v = self.v_proj(x).reshape(n, self.num_heads, self.head_dim)
        q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
        outs = [
            F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)).transpose(0, 1)
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))
        ]
        return self.o_proj(torch.cat(outs).reshape(n, -1))


class PixtralMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PixtralAttentionLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, eps=PIXTRAL_NORM_EPS)
        self.attention = PixtralAttention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=PIXTRAL_NORM_EPS)
        self.feed_forward = PixtralMLP(config)

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), lengths, cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralAttentionLayer(config) for _ in range(config.num_hidden_layers))


class PixtralVisionModel(nn.Module):
    """forward(images) -> hidden states of the requested layers, each [N, hidden], N the patches of all
    images (each image's row-major, the images in order)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_size = config.patch_size
        self.patch_conv = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=self.patch_size, stride=self.patch_size, bias=False
        )
        self.ln_pre = RMSNorm(config.hidden_size, eps=PIXTRAL_NORM_EPS)
        self.transformer = PixtralTransformer(config)
        self.patch_positional_embedding = PixtralRotaryEmbedding(
            config.hidden_size // config.num_attention_heads, _rope_theta(config)
        )

    def forward(
        self, images: Sequence[torch.Tensor], feature_layers: Union[int, Sequence[int]] = -1
    ) -> Union[torch.Tensor, list[torch.Tensor]]:
        """images: [C, H, W] each, H and W multiples of patch_size (any aspect ratio). feature_layers index
        HF's hidden_states (0: ln_pre's output, i: layer i's, -1: the last layer's): one index gives one
        [N, hidden] tensor, a list gives a list."""
        weight, p = self.patch_conv.weight, self.patch_size
        grids = [(image.shape[-2] // p, image.shape[-1] // p) for image in images]
        patches = []
        for image, (rows, cols) in zip(images, grids):
            pixels = image.to(device=weight.device, dtype=weight.dtype)[None, :, : rows * p, : cols * p]
            patches.append(self.patch_conv(pixels).flatten(2)[0].T)  # [rows * cols, hidden], row-major
        x = self.ln_pre(torch.cat(patches))
        lengths = [r * c for r, c in grids]
        cos, sin = self.patch_positional_embedding(grids, x.device)
        num_states = len(self.transformer.layers) + 1
        wanted = [feature_layers] if isinstance(feature_layers, int) else list(feature_layers)
        if any(not -num_states <= i < num_states for i in wanted):
            raise ValueError(f"feature layers {feature_layers} out of range for {num_states} hidden states")
        wanted = [i % num_states for i in wanted]
        states = {0: x}
        for i, layer in enumerate(self.transformer.layers[: max(wanted)], start=1):
            x = layer(x, lengths, cos, sin)
            states[i] = x
        return states[wanted[0]] if isinstance(feature_layers, int) else [states[i] for i in wanted]
