"""Qwen2-VL's vision transformer: patch embedding, blocks with 2-D rotary attention over each item's
own patches, and the patch merger that fuses spatial_merge_size**2 neighbouring patches into one
language-model token. Module names mirror Hugging Face's `Qwen2VisionTransformerPretrainedModel`.

Input: the processor's flattened patches [N, C * temporal_patch_size * patch**2] of all items, in
its merge-block-major order, with their grid_thw [n, 3]; output: [N / merge**2, hidden].
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tessera.layers.activations import get_activation
from tessera.layers.linear import Linear
from tessera.layers.vision_rotary import VisionRotaryEmbedding, apply_rotary_pos_emb_vision


class Qwen2VisionPatchEmbed(nn.Module):
    """HF's Conv3d with kernel = stride = (temporal_patch_size, patch, patch): on patches that the
    processor already cut and flattened in (C, T, P, P) order it is one matrix product."""

    def __init__(self, config: PretrainedConfig, embed_dim: Optional[int] = None) -> None:
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.embed_dim = embed_dim or config.embed_dim
        self.proj = nn.Conv3d(config.in_channels, self.embed_dim, kernel, stride=kernel, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.reshape(self.embed_dim, -1)
        return F.linear(pixel_values.to(weight.dtype).reshape(-1, weight.shape[1]), weight)


class Qwen2VisionAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, embed_dim: Optional[int] = None) -> None:
        super().__init__()
        dim = embed_dim or config.embed_dim  # Qwen2.5-VL's tower: its hidden_size
        self.num_heads = config.num_heads
        self.head_dim = dim // config.num_heads
        self.qkv = Linear(dim, 3 * dim, bias=True)
        self.proj = Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, dim]; every item attends to its own `lengths[i]` patches only (block-diagonal)."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
        outs = [
            F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)).transpose(0, 1)
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))
        ]
        return self.proj(torch.cat(outs).reshape(n, -1))


class Qwen2VisionMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = int(config.embed_dim * config.mlp_ratio)
        self.fc1 = Linear(config.embed_dim, hidden, bias=True)
        self.act = get_activation(config.hidden_act)
        self.fc2 = Linear(hidden, config.embed_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Qwen2VisionBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.embed_dim, eps=1e-6)
        self.attn = Qwen2VisionAttention(config)
        self.mlp = Qwen2VisionMLP(config)

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), lengths, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen2VisionPatchMerger(nn.Module):
    """LayerNorm, then a 2-layer GELU MLP over each merge block's concatenated patches."""

    def __init__(self, dim: int, context_dim: int, spatial_merge_size: int) -> None:
        super().__init__()
        self.hidden_size = context_dim * spatial_merge_size**2
        self.ln_q = nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            Linear(self.hidden_size, self.hidden_size, bias=True), nn.GELU(), Linear(self.hidden_size, dim, bias=True)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.hidden_size))


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_embed = Qwen2VisionPatchEmbed(config)
        self.rotary_pos_emb = VisionRotaryEmbedding.from_config(config)
        self.blocks = nn.ModuleList(Qwen2VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen2VisionPatchMerger(config.hidden_size, config.embed_dim, config.spatial_merge_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, patch_dim], grid_thw [n, 3] -> merged tokens [N / merge**2, hidden].
        Attention is per frame (HF's cu_seqlens: t runs of h * w patches per item)."""
        grid = torch.as_tensor(grid_thw).tolist()
        lengths = [h * w for t, h, w in grid for _ in range(t)]
        if sum(lengths) != pixel_values.shape[0]:
            raise ValueError(f"grid_thw {grid} gives {sum(lengths)} patches; pixel_values has {pixel_values.shape[0]}")
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary_pos_emb(grid, device=x.device)
        for block in self.blocks:
            x = block(x, lengths, cos, sin)
        return self.merger(x)
