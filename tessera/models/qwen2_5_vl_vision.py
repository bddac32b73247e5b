"""Qwen2.5-VL's vision transformer: Qwen2-VL's patch embedding and 2-D rotary attention, with RMSNorm,
a SwiGLU MLP, window attention and an RMSNorm patch merger. Module names mirror Hugging Face's
`Qwen2_5_VisionTransformerPretrainedModel`.

Window attention: each frame's merged-token grid (h / merge x w / merge) is cut into windows of
window_size / merge / patch merged tokens a side (the last row and column of windows may be
smaller); the tower reorders its patches window by window (HF's get_window_index: frame, window
row, window column, then row-major inside the window, each merged token's merge**2 patches kept
together), runs the blocks in that order, and puts the merged tokens back in the processor's order
after the merger. Blocks in `fullatt_block_indexes` attend over each whole frame, the others within
each window.

Input: the processor's flattened patches [N, C * temporal_patch_size * patch**2] of all items, in
its merge-block-major order, with their grid_thw [n, 3]; output: [N / merge**2, out_hidden_size].
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.layers.activations import get_activation
from tessera.layers.layernorm import RMSNorm
from tessera.layers.linear import Linear
from tessera.layers.vision_rotary import VisionRotaryEmbedding
from tessera.models.qwen2_vl_vision import Qwen2VisionAttention, Qwen2VisionPatchEmbed


def window_index(grid: list[list[int]], spatial_merge_size: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(index [N / merge**2]: the merged tokens in window order, the patch count of each window), for
    items of grids `grid` whose windows are `window` merged tokens a side."""
    if window < 1:
        raise ValueError(f"window_size must span at least one merged patch; got {window} merged patches")
    index, lengths, base = [], [], 0
    for t, h, w in grid:
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        ids = torch.arange(t * gh * gw).reshape(t, gh, gw) + base
        for frame in ids:
            for row in range(0, gh, window):
                for col in range(0, gw, window):
                    win = frame[row : row + window, col : col + window].flatten()
                    index.append(win)
                    lengths.append(win.numel() * spatial_merge_size**2)
        base += t * gh * gw
    return (torch.cat(index) if index else torch.zeros(0, dtype=torch.long)), lengths


class Qwen2_5_VisionMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2_5_VisionBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, eps=1e-6)
        self.norm2 = RMSNorm(config.hidden_size, eps=1e-6)
        self.attn = Qwen2VisionAttention(config, embed_dim=config.hidden_size)
        self.mlp = Qwen2_5_VisionMLP(config)

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), lengths, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen2_5_VisionPatchMerger(nn.Module):
    """RMSNorm, then a 2-layer GELU MLP over each merge block's concatenated patches."""

    def __init__(self, dim: int, context_dim: int, spatial_merge_size: int) -> None:
        super().__init__()
        self.hidden_size = context_dim * spatial_merge_size**2
        self.ln_q = RMSNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(
            Linear(self.hidden_size, self.hidden_size, bias=True), nn.GELU(), Linear(self.hidden_size, dim, bias=True)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.hidden_size))


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.spatial_merge_size = config.spatial_merge_size
        self.window = config.window_size // config.spatial_merge_size // config.patch_size  # in merged patches
        self.fullatt_block_indexes = set(config.fullatt_block_indexes)
        self.patch_embed = Qwen2VisionPatchEmbed(config, embed_dim=config.hidden_size)
        self.rotary_pos_emb = VisionRotaryEmbedding.from_config(config)
        self.blocks = nn.ModuleList(Qwen2_5_VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen2_5_VisionPatchMerger(config.out_hidden_size, config.hidden_size, config.spatial_merge_size)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, patch_dim], grid_thw [n, 3] -> merged tokens [N / merge**2, out_hidden_size]."""
        grid = torch.as_tensor(grid_thw).tolist()
        frame_lengths = [h * w for t, h, w in grid for _ in range(t)]
        n = pixel_values.shape[0]
        if sum(frame_lengths) != n:
            raise ValueError(f"grid_thw {grid} gives {sum(frame_lengths)} patches; pixel_values has {n}")
        unit = self.spatial_merge_size**2
        index, window_lengths = window_index(grid, self.spatial_merge_size, self.window)
        index = index.to(pixel_values.device)

        def to_windows(x: torch.Tensor) -> torch.Tensor:  # merged-token groups of patches, in window order
            return x.reshape(n // unit, unit, -1)[index].reshape(n, -1)

        x = to_windows(self.patch_embed(pixel_values))
        cos, sin = (to_windows(e) for e in self.rotary_pos_emb(grid, device=x.device))
        for i, block in enumerate(self.blocks):
            x = block(x, frame_lengths if i in self.fullatt_block_indexes else window_lengths, cos, sin)
        return self.merger(x)[torch.argsort(index)]
