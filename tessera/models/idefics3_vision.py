"""Idefics3's vision tower (HF's Idefics3VisionTransformer, Idefics2's): SigLIP's encoder over tiles of
variable size. A tile's real patches (`patch_attention_mask`, from the processor's pixel mask) get the
positions of a fixed num_patches_per_side**2 table, bucketed by their fractional coordinates, so a
smaller tile stretches over the whole table; padded patches are masked out of attention.

Module names mirror Hugging Face's, so checkpoints load without renaming (q/k/v fused on load); the
encoder layers are CLIP's (the same modules and names), given the padding mask.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from tessera.models.clip import CLIPEncoderLayer


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


class Idefics3Encoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers))


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
