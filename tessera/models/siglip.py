"""SigLIP vision tower (as used by LLaVA-OneVision): patch embedding with a bias, learned positions, no
CLS token, a bidirectional transformer (CLIP's encoder layer), post layer norm and optional attention
pooling head.

Module names mirror Hugging Face's `SiglipVisionModel` in the hub layout ("vision_model." level).
Multimodal models read hidden states of inner layers, so `forward` with `feature_layers` returns the
requested layers' outputs (indexed as HF's `hidden_states` tuple: before the post layer norm) and skips
the layers after the deepest one; without them it returns what HF's `last_hidden_state` and
`pooler_output` are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch
from torch import nn
from transformers import SiglipVisionConfig

from tessera.models.clip import CLIPMLP, CLIPEncoderLayer


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, stride=config.patch_size, bias=True
        )
        self.num_positions = (config.image_size // config.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C, H, W] (H, W: the config's image_size) -> [N, num_patches, hidden]."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        if patches.shape[1] != self.num_positions:
            raise ValueError(
                f"SigLIP takes images of its image_size ({self.num_positions} patches); got {patches.shape[1]} patches"
            )
        return patches + self.position_embedding.weight[None]


class SiglipEncoder(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(config.num_hidden_layers))


class SiglipMultiheadAttentionPoolingHead(nn.Module):
    """A learned probe attending over the patches (HF's names: probe, attention, layernorm, mlp)."""

    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.empty(1, 1, config.hidden_size))
        self.attention = nn.MultiheadAttention(config.hidden_size, config.num_attention_heads, batch_first=True)
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = CLIPMLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        probe = self.probe.expand(hidden.shape[0], -1, -1)
        hidden = self.attention(probe, hidden, hidden, need_weights=False)[0]
        return (hidden + self.mlp(self.layernorm(hidden)))[:, 0]


class SiglipVisionTransformer(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if getattr(config, "vision_use_head", True):
            self.head = SiglipMultiheadAttentionPoolingHead(config)


class SiglipVisionModel(nn.Module):
    def __init__(self, config: SiglipVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = SiglipVisionTransformer(config)

    def forward(
        self, pixel_values: torch.Tensor, feature_layers: Optional[Sequence[int]] = None
    ) -> Union[list[torch.Tensor], tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """With `feature_layers`: the hidden states at those layers (0: the embeddings, i: after layer
        i; negative from the end), each [N, num_patches, hidden]. Without: (last_hidden_state after the
        post layer norm [N, num_patches, hidden], the head's pooled output [N, hidden] or None)."""
        model = self.vision_model
        num_states = len(model.encoder.layers) + 1
        wanted = [layer % num_states for layer in feature_layers] if feature_layers is not None else [num_states - 1]
        states = {0: model.embeddings(pixel_values)}
        hidden = states[0]
        for i, layer in enumerate(model.encoder.layers[: max(wanted)], start=1):
            hidden = states[i] = layer(hidden)
        if feature_layers is not None:
            return [states[i] for i in wanted]
        last = model.post_layernorm(hidden)
        return last, (model.head(last) if hasattr(model, "head") else None)
