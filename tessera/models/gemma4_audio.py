"""Gemma 4's audio encoder (USM, the Universal Speech Model: a Conformer). Two stride-2 3x3 convolutions over
the log-mel frames (each followed by a bias-free layer norm and ReLU) keep one position in four, a linear
layer maps them to hidden_size; then Conformer layers, each a half-step feed-forward, chunked local self-attention
with relative positions (Transformer-XL style, logits soft-capped), a gated causal depthwise convolution and a
second half-step feed-forward; a final linear layer (`output_proj`) gives output_proj_dims per position. Most
linear layers clamp their inputs and outputs to bounds stored in the checkpoint (`Gemma4ClippableLinear`).

Weights keep transformers' names (Gemma4AudioModel's state dict, the checkpoint's `model.audio_tower.*`). As
transformers, attention and normalisation run in float32, the rest in the module's dtype; the relative position
table is computed in float32 here, in the default dtype at init there.

Tokens per clip: a position is kept when its mel frame 4 * i is valid (the mask is subsampled as `mask[::2]`
twice), so a clip whose first n frames are valid gives ceil(n / 4) tokens, 25 a second; padded positions are
dropped, as Gemma4Model.forward does. Nothing caps the count: the feature extractor cuts clips at 30 s (2999
frames, 750 tokens), the processor's `audio_seq_length` (750) only caps counts computed from sample lengths.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.layers.activations import get_activation
from tessera.models.gemma4 import Gemma4RMSNorm
from tessera.models.gemma4_vision import Gemma4ClippableLinear


def num_audio_tokens(num_valid_frames: int) -> int:
    """Soft tokens of a clip whose first `num_valid_frames` mel frames are valid (the processor's count)."""
    return (num_valid_frames + 3) // 4  # ceil(ceil(n / 2) / 2): each stride-2 convolution keeps mask[::2]


def _clip(x: torch.Tensor, limit: float) -> torch.Tensor:
    """transformers' `gradient_clipping` clamp, bounded by the dtype's range so it never overflows."""
    limit = min(limit, torch.finfo(x.dtype).max)
    return torch.clamp(x, -limit, limit)


class Gemma4AudioSubSampleConvProjectionLayer(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(out_channels, eps=eps, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, C_in, T, F]; mask [B, T] -> [B, C_out, ceil(T / 2), ceil(F / 2)], mask [B, ceil(T / 2)]."""
        x = x * mask[:, None, :, None]  # padded frames read as zeros, as a clip of its own would see them
        x = self.conv(x.to(self.conv.weight.dtype))
        x = F.relu(self.norm(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)  # norm over channels
        return x, mask[:, ::2]


class Gemma4AudioSubSampleConvProjection(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        c0, c1 = config.subsampling_conv_channels
        self.layer0 = Gemma4AudioSubSampleConvProjectionLayer(1, c0, config.rms_norm_eps)
        self.layer1 = Gemma4AudioSubSampleConvProjectionLayer(c0, c1, config.rms_norm_eps)
        # transformers sizes this from the channels: ceil(ceil(mel_bins / 2) / 2) must equal c0 // 4 (128 mel
        # bins with the default c0 = 128)
        self.input_proj_linear = nn.Linear((c0 // 4) * c1, config.hidden_size, bias=False)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, T, mel_bins]; mask [B, T] -> [B, T', hidden_size], mask [B, T'] (T' = ceil(T / 4))."""
        x, mask = self.layer0(features.unsqueeze(1), mask)
        x, mask = self.layer1(x, mask)  # [B, c1, T', F']
        x = x.permute(0, 2, 3, 1).flatten(2)  # [B, T', F' * c1], frequency-major as transformers
        return self.input_proj_linear(x), mask


class Gemma4AudioFeedForward(nn.Module):
    """Macaron half-step feed-forward: x + residual_weight * norm(W2 act(W1 norm(x)))."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.ffw_layer_1 = Gemma4ClippableLinear(config.hidden_size, config.hidden_size * 4, config.use_clipped_linears)
        self.ffw_layer_2 = Gemma4ClippableLinear(config.hidden_size * 4, config.hidden_size, config.use_clipped_linears)
        self.pre_layer_norm = Gemma4RMSNorm(config.hidden_size)  # eps 1e-6 regardless of the config, as HF
        self.post_layer_norm = Gemma4RMSNorm(config.hidden_size)
        self.act = get_activation(config.hidden_act)
        self.clip = config.gradient_clipping
        self.scale = config.residual_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ffw_layer_2(self.act(self.ffw_layer_1(self.pre_layer_norm(_clip(x, self.clip)))))
        return self.post_layer_norm(_clip(h, self.clip)) * self.scale + x


class Gemma4AudioLightConv1d(nn.Module):
    """Gated (GLU) causal depthwise convolution over time."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        d = config.hidden_size
        self.linear_start = Gemma4ClippableLinear(d, d * 2, config.use_clipped_linears)
        self.linear_end = Gemma4ClippableLinear(d, d, config.use_clipped_linears)
        self.depthwise_conv1d = nn.Conv1d(d, d, config.conv_kernel_size, groups=d, bias=False)
        self.pre_layer_norm = Gemma4RMSNorm(d, eps=config.rms_norm_eps)
        self.conv_norm = Gemma4RMSNorm(d, eps=config.rms_norm_eps)
        self.act = get_activation(config.hidden_act)
        self.clip = config.gradient_clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)  # [B, T, D]
        h = F.pad(h.transpose(1, 2), (self.depthwise_conv1d.kernel_size[0] - 1, 0))  # causal: left padding only
        h = self.depthwise_conv1d(h).transpose(1, 2)  # [B, T, D]
        return self.linear_end(self.act(self.conv_norm(_clip(h, self.clip)))) + x


def relative_position_table(config: Any, device: torch.device) -> torch.Tensor:
    """[R, hidden_size] float32 sinusoids (sines then cosines) for relative distances R - 1, ..., 1, 0, where
    R = context // 2 + 1 (transformers' Gemma4AudioRelPositionalEncoding; the context is chunk + past + future)."""
    context = config.attention_chunk_size + config.attention_context_left - 1 + config.attention_context_right
    n = config.hidden_size // 2
    inv_timescales = torch.exp(torch.arange(n, device=device) * -(math.log(10000.0) / max(n - 1, 1)))
    scaled = torch.arange(context // 2, -1, -1, device=device)[:, None] * inv_timescales  # [R, n]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=-1)


def blocked_attention_mask(config: Any, valid: torch.Tensor) -> torch.Tensor:
    """[B, T] valid positions -> [B, 1, N, C, W] bool, True where query c of chunk n may not read its context
    key w: a padded key, a query past the end, or a key outside transformers' window 0 <= q - k < context_left - 1,
    0 < k - q < context_right. That window is one key short on each side of the keys gathered per chunk
    (past = context_left - 1 back, future ahead): the farthest past key never counts, as in transformers."""
    c, past, future = config.attention_chunk_size, config.attention_context_left - 1, config.attention_context_right
    t = valid.shape[1]
    start = torch.arange(-(-t // c), device=valid.device)[:, None] * c  # [N, 1]
    q = start + torch.arange(c, device=valid.device)  # [N, C] query positions
    k = start - past + torch.arange(past + c + future, device=valid.device)  # [N, W] key positions
    dist = q[:, :, None] - k[:, None, :]  # [N, C, W]
    window = ((dist >= 0) & (dist < past)) | ((dist < 0) & (-dist < future))
    window &= (q < t)[:, :, None]  # rows past the end (dropped later), as transformers pads its mask
    keys = F.pad(valid, (past, future + c))[:, k + past]  # [B, N, W]; keys before 0 or from T on read False
    return ~(window & keys[:, :, None, :])[:, None]


class Gemma4AudioAttention(nn.Module):
    """Chunked local self-attention in float32: queries in chunks of C = attention_chunk_size, each chunk reading
    W = past + C + future keys around it; logits are content (q.k) plus a Transformer-XL relative position term,
    soft-capped with tanh. Queries are scaled per dimension (softplus(per_dim_scale)) and keys by a constant."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = d // self.num_heads
        self.q_scale = self.head_dim**-0.5 / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        self.chunk = config.attention_chunk_size
        self.past, self.future = config.attention_context_left - 1, config.attention_context_right
        self.context = self.chunk + self.past + self.future  # W
        self.softcap = config.attention_logit_cap
        self.invalid = config.attention_invalid_logits_value
        self.q_proj = Gemma4ClippableLinear(d, self.num_heads * self.head_dim, config.use_clipped_linears)
        self.k_proj = Gemma4ClippableLinear(d, self.num_heads * self.head_dim, config.use_clipped_linears)
        self.v_proj = Gemma4ClippableLinear(d, self.num_heads * self.head_dim, config.use_clipped_linears)
        self.post = Gemma4ClippableLinear(d, d, config.use_clipped_linears)
        self.relative_k_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim))

    def _context(self, s: torch.Tensor) -> torch.Tensor:
        """[B, T, H, Dh] -> [B, N, W, H, Dh]: each chunk's keys from `past` before it to `future` after it."""
        s = F.pad(s, (0, 0, 0, 0, self.past, self.future + self.chunk - 1))  # zeros outside the clip
        return s.unfold(1, self.context, self.chunk).movedim(-1, 2)

    def _rel_shift(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, N, C, R] scores per relative distance -> [B, H, N, C, W] per context key: Transformer-XL's
        pad-and-reshape, row i shifted right by i (key w of query i reads distance index w - i, else zero)."""
        b, h, n, c, r = x.shape
        x = F.pad(x, (0, self.context + 1 - r)).view(b, h, n, c * (self.context + 1))
        return x[..., : c * self.context].view(b, h, n, c, self.context)

    def forward(self, x: torch.Tensor, rel_pos: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        """x [B, T, D]; rel_pos [R, D]; blocked [B, 1, N, C, W] (True: not attended) -> [B, T, D]."""
        b, t, _ = x.shape
        h, dh = self.num_heads, self.head_dim
        q = self.q_proj(x).float().view(b, t, h, dh) * self.q_scale * F.softplus(self.per_dim_scale)
        k = self._context(self.k_proj(x).float().view(b, t, h, dh) * self.k_scale)  # [B, N, W, H, Dh]
        v = self._context(self.v_proj(x).float().view(b, t, h, dh))  # [B, N, W, H, Dh]
        n = k.shape[1]
        q = F.pad(q, (0, 0, 0, 0, 0, n * self.chunk - t)).view(b, n, self.chunk, h, dh).permute(0, 3, 1, 2, 4)
        content = q @ k.permute(0, 3, 1, 4, 2)  # [B, H, N, C, W]
        rel_k = self.relative_k_proj(rel_pos).view(-1, h, dh).float()  # [R, H, Dh]
        position = q.reshape(b, h, n * self.chunk, dh) @ rel_k.permute(1, 2, 0)  # [B, H, N * C, R]
        position = self._rel_shift(position.view(b, h, n, self.chunk, -1))  # [B, H, N, C, W]
        logits = torch.tanh((content + position) / self.softcap) * self.softcap
        probs = torch.softmax(logits.masked_fill(blocked, self.invalid), dim=-1)  # a fully blocked row: uniform
        out = (probs @ v.permute(0, 3, 1, 2, 4)).permute(0, 2, 3, 1, 4)  # [B, N, C, H, Dh]
        return self.post(out.reshape(b, n * self.chunk, h * dh)[:, :t].to(x.dtype))


class Gemma4AudioLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.feed_forward1 = Gemma4AudioFeedForward(config)
        self.feed_forward2 = Gemma4AudioFeedForward(config)
        self.self_attn = Gemma4AudioAttention(config)
        self.lconv1d = Gemma4AudioLightConv1d(config)
        self.norm_pre_attn = Gemma4RMSNorm(config.hidden_size)
        self.norm_post_attn = Gemma4RMSNorm(config.hidden_size)
        self.norm_out = Gemma4RMSNorm(config.hidden_size)
        self.clip = config.gradient_clipping

    def forward(self, x: torch.Tensor, rel_pos: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(_clip(x, self.clip)), rel_pos, blocked)
        x = self.norm_post_attn(_clip(h, self.clip)) + x
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(_clip(x, self.clip))


class Gemma4AudioModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.subsample_conv_projection = Gemma4AudioSubSampleConvProjection(config)
        self.layers = nn.ModuleList(Gemma4AudioLayer(config) for _ in range(config.num_hidden_layers))
        self.output_proj = nn.Linear(config.hidden_size, config.output_proj_dims)

    def encode(
        self, input_features: torch.Tensor, input_features_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T, mel_bins], [B, T] bool -> every position [B, T', output_proj_dims] and its mask [B, T'] bool
        (transformers' last_hidden_state and attention_mask)."""
        x, mask = self.subsample_conv_projection(input_features, input_features_mask.bool())
        rel_pos = relative_position_table(self.config, x.device).to(x.dtype)  # [R, D], cast as transformers
        blocked = blocked_attention_mask(self.config, mask)  # [B, 1, blocks, chunk, context], once for all layers
        for layer in self.layers:
            x = layer(x, rel_pos, blocked)
        return self.output_proj(x), mask

    def forward(self, input_features: torch.Tensor, input_features_mask: torch.Tensor) -> list[torch.Tensor]:
        """[B, T, mel_bins] log-mel features, [B, T] bool (True: a real frame) -> per clip its valid positions
        [num tokens, output_proj_dims], before the language model's audio embedder (embed_audio)."""
        out, mask = self.encode(input_features, input_features_mask)
        return [clip_out[clip_mask] for clip_out, clip_mask in zip(out, mask)]
