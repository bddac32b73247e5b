"""InternViT vision tower as transformers 5.23 defines it (InternVLVisionModel): a patch convolution, a CLS
token and absolute position embeddings, then pre-norm layers with layer scale (lambda_1 on the attention
output, lambda_2 on the MLP output), optional RMS qk-norm over the whole projection width, LayerNorm or
RMSNorm per `norm_type`, and a final LayerNorm unless `use_mean_pooling`. Module names mirror HF's, so
its state dicts load under the `vision_tower.` prefix (q/k/v projections are merged on load).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tessera.layers.activations import get_activation
from tessera.layers.linear import Linear, MergedLinear


def _pair(value) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (list, tuple)) else (int(value), int(value))


class InternVLVisionRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def _norm(config: PretrainedConfig) -> nn.Module:
    if config.norm_type == "layer_norm":
        return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
    if config.norm_type == "rms_norm":
        return InternVLVisionRMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    raise ValueError(f"Unsupported InternVL vision norm_type {config.norm_type!r}; supported: layer_norm, rms_norm")


class InternVLVisionPatchEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        image_size, patch_size = _pair(config.image_size), _pair(config.patch_size)
        self.num_patches = (image_size[0] // patch_size[0]) * (image_size[1] // patch_size[1])
        self.projection = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=patch_size, stride=patch_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.projection(pixel_values.to(self.projection.weight.dtype)).flatten(2).transpose(1, 2)


class InternVLVisionEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        # masked image modeling only; kept so that checkpoints that have it load
        self.mask_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size)) if config.use_mask_token else None
        self.patch_embeddings = InternVLVisionPatchEmbeddings(config)
        self.patch_size = _pair(config.patch_size)
        num_patches = self.patch_embeddings.num_patches
        self.position_embeddings = (
            nn.Parameter(torch.zeros(1, num_patches + 1, config.hidden_size))
            if config.use_absolute_position_embeddings
            else None
        )

    def _position_embeddings(self, num_patches: int, height: int, width: int) -> torch.Tensor:
        """HF's interpolate_pos_encoding: the table as is for its own square size, else bicubic."""
        table = self.position_embeddings
        num_positions = table.shape[1] - 1
        if num_patches == num_positions and height == width:
            return table
        side = int(num_positions**0.5)
        grid = table[:, 1:].reshape(1, side, side, -1).permute(0, 3, 1, 2)
        size = (height // self.patch_size[0], width // self.patch_size[1])
        grid = F.interpolate(grid, size=size, mode="bicubic", align_corners=False)
        return torch.cat([table[:, :1], grid.permute(0, 2, 3, 1).reshape(1, -1, table.shape[-1])], dim=1)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] -> [N, 1 + patches, hidden]."""
        height, width = pixel_values.shape[-2:]
        patches = self.patch_embeddings(pixel_values)
        x = torch.cat([self.cls_token.expand(patches.shape[0], -1, -1).to(patches.dtype), patches], dim=1)
        if self.position_embeddings is not None:
            x = x + self._position_embeddings(patches.shape[1], height, width).to(x.dtype)
        return x


class InternVLVisionAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        if self.head_dim * self.num_heads != hidden:
            raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {self.num_heads}")
        shards = {"q_proj": hidden, "k_proj": hidden, "v_proj": hidden}
        self.qkv_proj = MergedLinear(hidden, shards, bias=bool(config.attention_bias))
        self.projection_layer = Linear(hidden, hidden)
        self.q_norm = InternVLVisionRMSNorm(hidden) if config.use_qk_norm else nn.Identity()
        self.k_norm = InternVLVisionRMSNorm(hidden) if config.use_qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, _ = x.shape
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.reshape(n, length, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.projection_layer(out.transpose(1, 2).reshape(n, length, -1))


class InternVLVisionMLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.act = get_activation(config.hidden_act)
        self.fc1 = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class InternVLVisionLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.attention = InternVLVisionAttention(config)
        self.mlp = InternVLVisionMLP(config)
        self.layernorm_before = _norm(config)
        self.layernorm_after = _norm(config)
        self.lambda_1 = nn.Parameter(torch.ones(config.hidden_size))
        self.lambda_2 = nn.Parameter(torch.ones(config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class InternVLVisionEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList([InternVLVisionLayer(config) for _ in range(config.num_hidden_layers)])


class InternVLVisionModel(nn.Module):
    """pixel_values [N, C, H, W] -> the hidden states HF's get_image_features reads (CLS included)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = InternVLVisionEmbeddings(config)
        self.encoder = InternVLVisionEncoder(config)
        self.layernorm = (
            nn.Identity() if config.use_mean_pooling else nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        )

    def forward(self, pixel_values: torch.Tensor, feature_layer: int = -1) -> torch.Tensor:
        """The final hidden states (after `layernorm`) for feature_layer -1, as HF; otherwise HF's
        hidden_states[feature_layer] (index 0: the embeddings, i: the output of layer i), and the
        layers after it are skipped."""
        layers = self.encoder.layer
        if feature_layer == -1:
            stop = len(layers)
        else:
            stop = feature_layer if feature_layer >= 0 else len(layers) + 1 + feature_layer
            if not 0 <= stop <= len(layers):
                raise ValueError(f"vision_feature_layer {feature_layer} is out of range for {len(layers)} layers")
        x = self.embeddings(pixel_values)
        for layer in layers[:stop]:
            x = layer(x)
        return self.layernorm(x) if feature_layer == -1 else x


def check_feature_layer(value: int | Sequence[int]) -> int:
    """HF's vision_feature_layer as an int (a list of layers is not supported)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(f"InternVL with several vision_feature_layer {list(value)} is not supported")
        value = value[0]
    return int(value)
