"""Qwen2.5-Omni's audio encoder: a Whisper encoder that reads only a recording's valid log-mel frames, cut into
windows of 2 * n_window frames (2 s). Each window gets the two convolutions and sinusoidal positions from 0 on
its own and attends only to itself; then pairs of positions are averaged over the whole recording, and a
layer norm (`ln_post`) and a projection (`proj`) to the language model's width follow. As transformers'
Qwen2_5OmniAudioEncoder (which packs the windows with cu_seqlens; here they are a padded batch with a key mask).

Tokens per recording of T mel frames (T <= 3000: the feature extractor cuts at 30 s): ((T - 1) // 2 + 1) // 2,
25 a second.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tessera.models.whisper_encoder import WhisperEncoderLayer, conv_output_frames


def omni_audio_tokens(mel_frames: int) -> int:
    """Language-model tokens of a recording with `mel_frames` valid frames."""
    return (conv_output_frames(mel_frames) - 2) // 2 + 1


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels] positions: sines then cosines over geometrically spaced timescales (Whisper's)."""
    # on the CPU explicitly: models are built under `with torch.device("meta")`, and this is no checkpoint tensor
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-increment * torch.arange(channels // 2, device="cpu").float())
    scaled = torch.arange(length, device="cpu")[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class Qwen2_5OmniAudioEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.window = 2 * config.n_window  # mel frames a window holds
        self.conv1 = nn.Conv1d(config.num_mel_bins, config.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(config.d_model, config.d_model, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positions", sinusoids(config.max_source_positions, config.d_model), persistent=False)
        self.audio_bos_eos_token = nn.Embedding(2, config.output_dim)  # in checkpoints; the model never reads it
        self.layers = nn.ModuleList(WhisperEncoderLayer(config) for _ in range(config.encoder_layers))
        self.ln_post = nn.LayerNorm(config.d_model)
        self.proj = nn.Linear(config.d_model, config.output_dim)

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each recording's valid frames [mel bins, T] -> its tokens [omni_audio_tokens(T), output_dim]."""
        pieces = [f.split(self.window, dim=1) for f in features]
        windows = [w for recording in pieces for w in recording]
        lengths = torch.tensor([w.shape[1] for w in windows])
        batch = torch.zeros(len(windows), windows[0].shape[0], int(lengths.max()), dtype=windows[0].dtype,
                            device=windows[0].device)  # fmt: skip
        for i, w in enumerate(windows):
            batch[i, :, : w.shape[1]] = w
        frame_mask = (torch.arange(batch.shape[2]) < lengths[:, None]).to(batch.device)[:, None]
        x = F.gelu(self.conv1(batch)) * frame_mask  # padding zeroed, as a window of its own would see it
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # [windows, positions, D]
        x = x + self.positions[: x.shape[1]].to(x.dtype)
        valid = conv_output_frames(lengths)
        keys = (torch.arange(x.shape[1]) < valid[:, None]).to(x.device)[:, None, None]
        for layer in self.layers:
            x = layer(x, keys)
        out, start = [], 0
        for recording in pieces:
            rows = torch.cat([x[start + i, : int(valid[start + i])] for i in range(len(recording))])
            start += len(recording)
            pairs = (rows.shape[0] - 2) // 2 + 1
            pooled = (rows[0 : 2 * pairs : 2] + rows[1 : 2 * pairs : 2]) / 2
            out.append(self.proj(self.ln_post(pooled)))
        return out
