"""Gemma 4's vision tower and its multimodal embedder. Module names mirror Hugging Face's `Gemma4VisionModel`
(`model.vision_tower.` in the hub layout) and `Gemma4MultimodalEmbedder` (`model.embed_vision.`,
`model.embed_audio.`).

Unlike the SigLIP / CLIP towers (a fixed square image, learned 1-D positions, LayerNorm), this one takes a
variable number of patches per image, padded to the batch's `max_patches`, each with its (x, y) patch
position (padding: (-1, -1)). Patches are embedded by one linear map of the pixels rescaled to [-1, 1] plus a
learned table per axis; the blocks are Gemma-style (RMSNorm before and after attention and the gated MLP,
RMS-normalised q, k and v, no 1/sqrt(head_dim) scaling) with 2-D rotary attention (half the channels turn
with x, half with y) and bidirectional attention over each image's real patches. Unlike Qwen2-VL's
merger there are no learned weights after the blocks: every pooling_kernel_size**2 square of patches is
averaged into one soft token, scaled by sqrt(hidden_size) and optionally standardized. Optional clipped
linears clamp every block projection's input and output to bounds stored in the checkpoint.

`Gemma4VisionModel.forward` returns the soft tokens of each image (HF's `last_hidden_state` split per image
as `Gemma4Model.get_image_features` splits it), before `Gemma4MultimodalEmbedder` maps them to the text width.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.layers.activations import get_activation
from tessera.layers.linear import Linear
from tessera.layers.rotary import rotate_half
from tessera.models.gemma4 import Gemma4RMSNorm


class Gemma4ClippableLinear(nn.Module):
    """A bias-free linear (`.linear`) whose input and output are clamped to the checkpoint's
    input_min/input_max/output_min/output_max (0-d persistent buffers) when the config asks for it."""

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__()
        self.clipped = clipped
        self.linear = Linear(in_features, out_features, bias=False)
        if clipped:
            for name, bound in (("input_min", -1), ("input_max", 1), ("output_min", -1), ("output_max", 1)):
                self.register_buffer(name, torch.tensor(bound * float("inf")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        x = self.linear(x)
        return torch.clamp(x, self.output_min, self.output_max) if self.clipped else x


class Gemma4VisionPatchEmbedder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.input_proj = Linear(3 * config.patch_size**2, config.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(torch.ones(2, config.position_embedding_size, config.hidden_size))

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, P, 3 * patch**2] in [0, 1], position_ids [B, P, 2], padding [B, P] -> [B, P, H]."""
        table = self.position_embedding_table
        # the processor does not normalize: the model maps [0, 1] to [-1, 1] (in the input's dtype, as HF)
        hidden = self.input_proj((2 * (pixel_values - 0.5)).to(table.dtype))  # [B, P, H]
        pos = position_ids.clamp(min=0)  # padding (-1) -> a valid index; its embedding is zeroed below
        emb = F.embedding(pos[..., 0], table[0]) + F.embedding(pos[..., 1], table[1])  # [B, P, H]
        return hidden + torch.where(padding[..., None], 0.0, emb)


class Gemma4VisionRotaryEmbedding(nn.Module):
    """HF's axial rope: head_dim / 4 frequencies (theta ** -(2i / (head_dim / 2))) shared by both axes; the first
    half of each head's channels turns with x, the second half with y. No state in the checkpoint: the table is
    built on CPU (towers are built on the meta device) and copied to each device once."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        spatial_dim = head_dim // 2
        exponents = torch.arange(0, spatial_dim, 2, dtype=torch.float, device="cpu") / spatial_dim
        self._inv_freq = {torch.device("cpu"): 1.0 / (theta**exponents)}  # [head_dim / 4]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, P, 2] -> (cos, sin), each [B, P, 1, 2, head_dim / 2] in `dtype` (HF casts them to
        the hidden dtype), broadcasting over heads and laid out per axis for `apply_axial_rope`."""
        device = position_ids.device
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq[torch.device("cpu")].to(device)
        freqs = position_ids[..., None].float() * self._inv_freq[device]  # [B, P, 2, head_dim / 4]
        emb = torch.cat([freqs, freqs], dim=-1)[:, :, None]  # [B, P, 1, 2, head_dim / 2]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, P, heads, head_dim]: HF's `apply_multidimensional_rope` with two axes, i.e. rotate_half rope on
    each half of the channels with its own axis' angles, as one batched op."""
    parts = x.unflatten(-1, (2, -1))  # [B, P, heads, 2, head_dim / 2]
    return (parts * cos + rotate_half(parts) * sin).flatten(-2)


class Gemma4VisionAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        clipped, hidden = config.use_clipped_linears, config.hidden_size
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = Gemma4ClippableLinear(hidden, self.num_heads * self.head_dim, clipped)
        self.k_proj = Gemma4ClippableLinear(hidden, self.num_kv_heads * self.head_dim, clipped)
        self.v_proj = Gemma4ClippableLinear(hidden, self.num_kv_heads * self.head_dim, clipped)
        self.o_proj = Gemma4ClippableLinear(self.num_heads * self.head_dim, hidden, clipped)
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.v_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, P, H]; mask [B, 1, 1, P] (True: a real patch, which every patch may attend to) -> [B, P, H]."""
        b, p, _ = x.shape
        q = apply_axial_rope(self.q_norm(self.q_proj(x).view(b, p, -1, self.head_dim)), cos, sin)  # [B, P, nh, d]
        k = apply_axial_rope(self.k_norm(self.k_proj(x).view(b, p, -1, self.head_dim)), cos, sin)  # [B, P, nkv, d]
        v = self.v_norm(self.v_proj(x).view(b, p, -1, self.head_dim))  # [B, P, nkv, d]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, P, d]
        if self.num_kv_heads != self.num_heads:  # GQA: kv head j serves query heads j * rep ... (HF's repeat_kv)
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        # scale 1: the q and k norms replace 1/sqrt(head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)  # [B, nh, P, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, p, -1))


class Gemma4VisionMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        clipped, hidden, inner = config.use_clipped_linears, config.hidden_size, config.intermediate_size
        self.gate_proj = Gemma4ClippableLinear(hidden, inner, clipped)
        self.up_proj = Gemma4ClippableLinear(hidden, inner, clipped)
        self.down_proj = Gemma4ClippableLinear(inner, hidden, clipped)
        self.act = get_activation(config.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma4VisionEncoderLayer(nn.Module):
    """Sandwich norms: RMSNorm before and after both the attention and the MLP, then the residual add."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4VisionAttention(config)
        self.mlp = Gemma4VisionMLP(config)
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma4VisionEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        rope = config.rope_parameters or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"Gemma 4's vision tower supports only axial rope, got rope_type {rope['rope_type']!r}")
        if config.head_dim % 4:
            raise ValueError(f"Gemma 4's 2-D rope needs head_dim divisible by 4, got {config.head_dim}")
        self.rotary_emb = Gemma4VisionRotaryEmbedding(config.head_dim, rope.get("rope_theta", 100.0))
        self.layers = nn.ModuleList(Gemma4VisionEncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x [B, P, H], position_ids [B, P, 2], valid [B, P] -> [B, P, H]. Padding patches only mask keys;
        their own rows are computed and dropped later."""
        cos, sin = self.rotary_emb(position_ids, x.dtype)  # padding's (-1, -1) angles only reach padding rows
        mask = valid[:, None, None, :]  # [B, 1, 1, P], bidirectional
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return x


class Gemma4VisionModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.pooling_kernel_size = config.pooling_kernel_size
        self.root_hidden_size = config.hidden_size**0.5
        self.patch_embedder = Gemma4VisionPatchEmbedder(config)
        self.encoder = Gemma4VisionEncoder(config)
        if config.standardize:  # soft token = (pooled - std_bias) * std_scale
            self.register_buffer("std_bias", torch.zeros(config.hidden_size))
            self.register_buffer("std_scale", torch.ones(config.hidden_size))

    def pool(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, padding: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's `Gemma4VisionPooler`: hidden [B, P, H] -> (soft tokens [B, length, H] float32, valid [B, length]).
        Patch (x, y) goes to cell (x // k) + (width // k) * (y // k) (width: the image's patch columns), each cell
        the mean of its k * k patches times sqrt(H). A one-hot matmul in float32 as HF's: deterministic, unlike a
        scatter-add, and it rounds as HF does (memory: B * P * length floats)."""
        k = self.pooling_kernel_size
        pos = position_ids.clamp(min=0)  # padding -> cell 0, adding zeros (its hidden states are zeroed)
        width = pos[..., 0].amax(dim=-1, keepdim=True) + 1  # [B, 1]
        cells = torch.div(pos, k, rounding_mode="floor")  # [B, P, 2]
        cell = cells[..., 0] + (width // k) * cells[..., 1]  # [B, P]
        weights = F.one_hot(cell.long(), length).float() / k**2  # [B, P, length]
        pooled = weights.transpose(1, 2) @ hidden.masked_fill(padding[..., None], 0.0).float()  # [B, length, H]
        valid = ~(weights == 0).all(dim=1)  # [B, length]: cells some patch falls in
        # HF rounds the mean to the hidden dtype, then scales in float32 (sqrt(H) can overflow float16)
        return pooled.to(hidden.dtype).float() * self.root_hidden_size, valid

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [B, P, 3 * patch**2] (the processor's, padded to P = max_patches), position_ids [B, P, 2]
        (x, y; padding (-1, -1)) -> per image its soft tokens [n_i, H], n_i = real patches / k**2, in the
        tower's dtype."""
        p = pixel_values.shape[1]
        k2 = self.pooling_kernel_size**2
        if p % k2:
            raise ValueError(f"Gemma 4's vision tower pools {k2} patches into one token; got {p} patches per image")
        padding = (position_ids == -1).all(dim=-1)  # [B, P]
        hidden = self.patch_embedder(pixel_values, position_ids, padding)  # [B, P, H]
        hidden = self.encoder(hidden, position_ids, ~padding)  # [B, P, H]
        pooled, valid = self.pool(hidden, position_ids, padding, p // k2)  # [B, P / k2, H], [B, P / k2]
        sizes = (~padding).sum(dim=-1) // k2  # [B]: how HF's get_image_features splits the flat tokens
        if not torch.equal(valid.sum(dim=-1), sizes):
            raise ValueError(
                f"Patch positions do not tile each image with {self.pooling_kernel_size}x{self.pooling_kernel_size} "
                f"squares: {valid.sum(dim=-1).tolist()} pooled cells, {sizes.tolist()} expected soft tokens"
            )
        tokens = pooled[valid]  # [sum n_i, H], image by image, padding dropped
        if self.config.standardize:  # in float32: subtracting std_bias cancels the large values
            tokens = (tokens - self.std_bias.float()) * self.std_scale.float()
        return list(tokens.to(hidden.dtype).split(sizes.tolist()))


class Gemma4MultimodalEmbedder(nn.Module):
    """Soft tokens [n, multimodal_hidden_size] -> [n, text_hidden_size]: an RMSNorm without weight, then a
    bias-free projection. Serves as `embed_vision` (the tower's hidden_size) and `embed_audio` (the audio
    config's output_proj_dims); eps: the tower's rms_norm_eps."""

    def __init__(self, multimodal_hidden_size: int, text_hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.embedding_projection = Linear(multimodal_hidden_size, text_hidden_size, bias=False)
        self.embedding_pre_projection_norm = Gemma4RMSNorm(multimodal_hidden_size, eps, with_scale=False)

    @classmethod
    def from_configs(cls, multimodal_config: Any, text_config: Any) -> Gemma4MultimodalEmbedder:
        """As HF builds it from the vision or audio config and the text config."""
        width = getattr(multimodal_config, "output_proj_dims", None) or multimodal_config.hidden_size
        return cls(width, text_config.hidden_size, multimodal_config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.embedding_pre_projection_norm(x)  # [n, Hm]
        return self.embedding_projection(normed.to(self.embedding_projection.weight.dtype))  # [n, H_text]
