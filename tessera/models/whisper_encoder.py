"""The Whisper encoder that audio LLMs put in front of their language model (Qwen2-Audio, Voxtral): two
convolutions over log-mel frames (the second strided: half as many positions), learned positions, pre-LN
transformer layers and a final layer norm; Qwen2-Audio averages pairs of positions before that norm.

Weights keep transformers' names (conv1, conv2, embed_positions, layers.N.self_attn.{q,k,v,out}_proj,
self_attn_layer_norm, fc1, fc2, final_layer_norm, layer_norm); the configs name their sizes as Whisper's
(d_model, encoder_layers, encoder_attention_heads, encoder_ffn_dim, num_mel_bins, max_source_positions).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


def conv_output_frames(mel_frames: torch.Tensor) -> torch.Tensor:
    """Positions after the strided convolution for `mel_frames` input frames."""
    return (mel_frames - 1) // 2 + 1


class WhisperAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads = config.encoder_attention_heads
        self.head_dim = config.d_model // self.num_heads
        self.q_proj = nn.Linear(config.d_model, config.d_model)
        self.k_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """x [N, L, D]; attn_mask [N, 1, 1, L] bool (True: a real frame to attend to) or None (all of them)."""
        n, length, _ = x.shape
        q, k, v = (p(x).reshape(n, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, -1))


class WhisperEncoderLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self_attn = WhisperAttention(config)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), attn_mask)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    def __init__(self, config: Any, *, pool: bool = False) -> None:
        super().__init__()
        self.pool = pool  # average pairs of positions before the final norm (Qwen2-Audio)
        self.conv1 = nn.Conv1d(config.num_mel_bins, config.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(config.d_model, config.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, config.d_model)
        self.layers = nn.ModuleList(WhisperEncoderLayer(config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(config.d_model)

    def forward(self, features: torch.Tensor, mel_frames: Optional[torch.Tensor] = None) -> torch.Tensor:
        """features [N, mel bins, 2 * max_source_positions] -> [N, max_source_positions (/ 2 pooled), D]. With
        `mel_frames` [N], attention sees only each window's valid frames (padded ones still come out)."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(features))))  # [N, D, L]
        x = x.transpose(1, 2) + self.embed_positions.weight  # every position, as HF
        mask = None
        if mel_frames is not None:
            valid = conv_output_frames(mel_frames).to(x.device)
            mask = (torch.arange(x.shape[1], device=x.device)[None] < valid[:, None])[:, None, None]
        for layer in self.layers:
            x = layer(x, mask)
        if self.pool:
            x = F.avg_pool1d(x.transpose(1, 2), kernel_size=2, stride=2).transpose(1, 2)
        return self.layer_norm(x)
