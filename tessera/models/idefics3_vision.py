"""Idefics3's vision tower (HF's Idefics3VisionTransformer, Idefics2's): SigLIP's encoder over tiles of
variable size. A tile's real patches (`patch_attention_mask`, from the processor's pixel mask) get the
positions of a fixed num_patches_per_side**2 table, bucketed by their fractional coordinates, so a
smaller tile stretches over the whole table; padded patches are masked out of attention.

Module names mirror Hugging Face's, so checkpoints load without renaming (q/k/v fused on load).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tessera.layers.activations import get_activation
from tessera.layers.linear import Linear, MergedLinear


class Idefics3VisionEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, stride=config.patch_size, padding="valid"
        )
        self.num_patches_per_side = config.image_size // config.patch_size
        self.position_embedding = nn.Embedding(self.num_patches_per_side**2, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor, patch_attention_mask: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, H, W], patch_attention_mask [N, H / patch, W / patch] -> [N, patches, hidden]."""
        n = pixel_values.shape[0]
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        embeddings = patches.flatten(2).transpose(1, 2)
        side = self.num_patches_per_side
        device = pixel_values.device
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)
        # As HF: each real patch's fractional coordinate in its tile, bucketed into the position table
        step_h = 1.0 / patch_attention_mask[:, :, 0].sum(dim=1)  # [N]
        step_w = 1.0 / patch_attention_mask[:, 0, :].sum(dim=1)
        h_idx = torch.arange(patch_attention_mask.shape[1], device=device, dtype=torch.float32)
        w_idx = torch.arange(patch_attention_mask.shape[2], device=device, dtype=torch.float32)
        coords_h = torch.clamp(h_idx[None] * step_h[:, None], max=1.0 - 1e-6)
        coords_w = torch.clamp(w_idx[None] * step_w[:, None], max=1.0 - 1e-6)
        bucket_h = torch.bucketize(coords_h, boundaries, right=True)
        bucket_w = torch.bucketize(coords_w, boundaries, right=True)
        pos_ids = (bucket_h[:, :, None] * side + bucket_w[:, None, :]).reshape(n, -1)
        position_ids = torch.where(patch_attention_mask.reshape(n, -1), pos_ids, torch.zeros_like(pos_ids))
        return embeddings + self.position_embedding(position_ids)


class Idefics3VisionAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv_proj = MergedLinear(hidden, {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden}, bias=True)
        self.out_proj = Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        n, length, _ = x.shape
        q, k, v = (
            t.reshape(n, length, self.num_heads, self.head_dim).transpose(1, 2)
            for t in self.qkv_proj.split(self.qkv_proj(x))
        )  # [N, H, L, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, -1))


class Idefics3VisionMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.fc1 = Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Idefics3EncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self_attn = Idefics3VisionAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = Idefics3VisionMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), attn_mask)
        return x + self.mlp(self.layer_norm2(x))


class Idefics3Encoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Idefics3EncoderLayer(config) for _ in range(config.num_hidden_layers))


class Idefics3VisionTransformer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.patch_size = config.patch_size
        self.embeddings = Idefics3VisionEmbeddings(config)
        self.encoder = Idefics3Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, patch_attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tiles [N, C, H, W] (their real patches in patch_attention_mask [N, H / patch, W / patch],
        all when None) -> [N, (H / patch) * (W / patch), hidden]."""
        n, _, height, width = pixel_values.shape
        if patch_attention_mask is None:
            shape = (n, height // self.patch_size, width // self.patch_size)
            patch_attention_mask = torch.ones(shape, dtype=torch.bool, device=pixel_values.device)
        hidden = self.embeddings(pixel_values, patch_attention_mask)
        keys = patch_attention_mask.reshape(n, 1, 1, -1)
        attn_mask = None if bool(keys.all()) else keys  # padded patches: no key for anyone
        for layer in self.encoder.layers:
            hidden = layer(hidden, attn_mask)
        return self.post_layernorm(hidden)
