"""Qwen3-VL's vision transformer: Qwen2-VL's 2-D rotary attention over each frame, a learned position
table resampled to every grid, and DeepStack: the hidden states after some blocks go through mergers
of their own and reach the first decoder layers. Module names mirror Hugging Face's `Qwen3VLVisionModel`.

Position table: `num_position_embeddings` = side**2 learned vectors on a square grid, bilinearly
resampled (align_corners) to each item's h x w patch grid and added to the patch embeddings
(transformers' `get_vision_interpolation_indices_and_weights`, used as is).

Input: the processor's flattened patches [N, C * temporal_patch_size * patch**2] of all items, in its
merge-block-major order, with their grid_thw [n, 3]; output: merged tokens [N / merge**2, out_hidden]
and one [N / merge**2, out_hidden] tensor per `deepstack_visual_indexes` block.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from tessera.layers.activations import get_activation
from tessera.layers.linear import Linear
from tessera.layers.vision_rotary import VisionRotaryEmbedding
from tessera.models.qwen2_vl_vision import Qwen2VisionAttention, Qwen2VisionPatchEmbed


class Qwen3VLVisionPatchEmbed(Qwen2VisionPatchEmbed):
    """Qwen2-VL's patch embedding with a bias."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config, embed_dim=config.hidden_size)
        kernel = self.proj.kernel_size
        self.proj = nn.Conv3d(config.in_channels, self.embed_dim, kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return super().forward(pixel_values) + self.proj.bias


class Qwen3VLVisionMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.linear_fc1 = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.act = get_activation(config.hidden_act)
        self.linear_fc2 = Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VLVisionBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = Qwen2VisionAttention(config, embed_dim=config.hidden_size)
        self.mlp = Qwen3VLVisionMLP(config)

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), lengths, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen3VLVisionPatchMerger(nn.Module):
    """LayerNorm, then a 2-layer GELU MLP over each merge block's concatenated patches. The main merger
    normalises each patch (hidden_size); DeepStack's normalise the concatenated block (postshuffle)."""

    def __init__(self, config: PretrainedConfig, use_postshuffle_norm: bool = False) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size * config.spatial_merge_size**2
        self.use_postshuffle_norm = use_postshuffle_norm
        self.norm = nn.LayerNorm(self.hidden_size if use_postshuffle_norm else config.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.hidden_size, self.hidden_size, bias=True)
        self.act_fn = nn.GELU()
        self.linear_fc2 = Linear(self.hidden_size, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_postshuffle_norm:
            x = self.norm(x.reshape(-1, self.hidden_size))
        else:
            x = self.norm(x).reshape(-1, self.hidden_size)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3VLVisionTransformer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_embed = Qwen3VLVisionPatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.num_grid_per_side = int(config.num_position_embeddings**0.5)
        self.rotary_pos_emb = VisionRotaryEmbedding.from_config(config)
        self.blocks = nn.ModuleList(Qwen3VLVisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen3VLVisionPatchMerger(config)
        self.deepstack_visual_indexes = list(getattr(config, "deepstack_visual_indexes", None) or [])  # none: Qwen3.5
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3VLVisionPatchMerger(config, use_postshuffle_norm=True) for _ in self.deepstack_visual_indexes
        )

    def position_embeddings(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """[N, hidden]: the learned square table resampled (bilinear, corners aligned) to each grid."""
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid_thw, self.num_grid_per_side, mode="bilinear", align_corners=True,
            spatial_merge_size=self.spatial_merge_size,
        )  # fmt: skip
        indices, weights = indices.to(self.pos_embed.weight.device), weights.to(self.pos_embed.weight.device)
        return (self.pos_embed(indices) * weights[:, :, None]).sum(1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values [N, patch_dim], grid_thw [n, 3] -> (merged tokens [N / merge**2, out_hidden],
        DeepStack features: one such tensor per deepstack block). Attention is per frame."""
        grid_thw = torch.as_tensor(grid_thw).reshape(-1, 3)
        grid = grid_thw.tolist()
        lengths = [h * w for t, h, w in grid for _ in range(t)]
        if sum(lengths) != pixel_values.shape[0]:
            raise ValueError(f"grid_thw {grid} gives {sum(lengths)} patches; pixel_values has {pixel_values.shape[0]}")
        x = self.patch_embed(pixel_values)
        x = x + self.position_embeddings(grid_thw.cpu()).to(x.dtype)
        cos, sin = self.rotary_pos_emb(grid, device=x.device)
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, lengths, cos, sin)
            if index in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(index)](x))
        return self.merger(x), deepstack
