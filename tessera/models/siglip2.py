"""SigLIP2 NaFlex vision tower (as LFM2-VL uses it): patches of any image shape, embedded by a linear layer
over the processor's flattened patches, with the learned square grid of positions resized (bilinear,
antialiased, as HF) to each image's patch grid; CLIP's bidirectional encoder layers; a post layer norm.

The processor pads every tile's patches to one length and masks the padding; here each tile runs unpadded
(tiles of one shape batched together), which gives HF's outputs for the real patches. Module names mirror
HF's `Siglip2VisionModel` (transformers 5: no `vision_model.` level).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tessera.models.clip import CLIPEncoder


class Siglip2VisionEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Linear(config.num_channels * config.patch_size**2, config.hidden_size)
        self.position_embedding = nn.Embedding(config.num_patches, config.hidden_size)
        self.position_embedding_size = int(config.num_patches**0.5)

    def forward(self, patches: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """patches [N, height * width, C * patch**2] of N tiles with a height x width patch grid -> [N, h * w, D]."""
        embeds = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))
        side, dim = self.position_embedding_size, embeds.shape[-1]
        grid = self.position_embedding.weight.reshape(side, side, dim).permute(2, 0, 1)[None]  # [1, D, side, side]
        resized = F.interpolate(
            grid.float(), size=(height, width), mode="bilinear", align_corners=False, antialias=True
        )
        return embeds + resized.reshape(dim, height * width).t().to(embeds.dtype)


class Siglip2VisionModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embeddings = Siglip2VisionEmbeddings(config)
        self.encoder = CLIPEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor, spatial_shapes: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [N, max_patches, C * patch**2] (each tile's first h * w rows real), spatial_shapes [N, 2]
        (h, w in patches) -> per tile its last hidden state [h * w, D], post layer norm applied."""
        shapes = [tuple(int(x) for x in shape) for shape in spatial_shapes.reshape(-1, 2)]
        out: list[torch.Tensor] = [torch.empty(0)] * len(shapes)
        for height, width in dict.fromkeys(shapes):  # tiles of one shape in one batch
            index = [i for i, shape in enumerate(shapes) if shape == (height, width)]
            x = self.embeddings(pixel_values[index, : height * width], height, width)
            for layer in self.encoder.layers:
                x = layer(x)
            x = self.post_layernorm(x)
            for row, i in enumerate(index):
                out[i] = x[row]
        return out
