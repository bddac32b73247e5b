"""CLIP vision tower (as used by LLaVA): patch embedding + bidirectional transformer.

Module names mirror Hugging Face's `CLIPVisionModel`. LLaVA reads hidden states of an inner layer,
so `forward` returns the requested layers' outputs and skips the layers after the deepest one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import CLIPVisionConfig

from tessera.layers.activations import get_activation
from tessera.layers.linear import Linear, MergedLinear


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, stride=config.patch_size, bias=False
        )
        self.num_positions = (config.image_size // config.patch_size) ** 2 + 1
        self.position_embedding = nn.Embedding(self.num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, H, W] -> [N, 1 + num_patches, hidden]."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [N, num_patches, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight[None]


class CLIPAttention(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        shards = {"q_proj": config.hidden_size, "k_proj": config.hidden_size, "v_proj": config.hidden_size}
        self.qkv_proj = MergedLinear(config.hidden_size, shards, bias=True)
        self.out_proj = Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [N, L, hidden]; attn_mask: boolean, broadcast to [N, H, L, L] (True: attend), e.g. to
        hide the padded patches of variable-size tiles (Idefics3)."""
        n, length, _ = x.shape
        q, k, v = (
            t.reshape(n, length, self.num_heads, self.head_dim).transpose(1, 2)
            for t in self.qkv_proj.split(self.qkv_proj(x))
        )  # [N, H, L, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, -1))


class CLIPMLP(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.fc1 = Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.self_attn = CLIPAttention(config)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), attn_mask)
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers))


class CLIPVisionTransformer(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # sic, HF's name
        self.encoder = CLIPEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class CLIPVisionModel(nn.Module):
    def __init__(self, config: CLIPVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = CLIPVisionTransformer(config)

    def forward(self, pixel_values: torch.Tensor, feature_layers: Sequence[int]) -> list[torch.Tensor]:
        """Hidden states at `feature_layers`, indexed as HF's `hidden_states` tuple (0: the
        embeddings, i: after layer i; negative from the end) -> each [N, 1 + num_patches, hidden]."""
        num_states = len(self.vision_model.encoder.layers) + 1
        wanted = [layer % num_states for layer in feature_layers]
        states = {0: self.vision_model.pre_layrnorm(self.vision_model.embeddings(pixel_values))}
        hidden = states[0]
        for i, layer in enumerate(self.vision_model.encoder.layers[: max(wanted)], start=1):
            hidden = states[i] = layer(hidden)
        return [states[i] for i in wanted]
