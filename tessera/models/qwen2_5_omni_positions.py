"""Qwen2.5-Omni's time-aligned M-RoPE (TMRoPE), as transformers' Qwen2.5-Omni `get_rope_index`.

Text, special tokens and audio tokens step one position at a time on all three axes (audio: 25 positions a
second). An image or video takes its merged patch grid at the next position: (start + t * step, start + h,
start + w), where a video's temporal step is position_id_per_seconds * the seconds one grid frame spans
(truncated after a float32 product, as HF); the token after it continues from the largest position of any
axis + 1. A video heard with its audio track (`use_audio_in_video`) is `<|vision_bos|><|audio_bos|>` (one shared
position p), its frames and its audio from p + 1 interleaved in 2-second chunks, then `<|audio_eos|>
<|vision_eos|>` (one shared position after the largest). Decoding continues 1-D: delta = max position + 1 -
prompt length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class OmniItem:
    """One item of a prompt as TMRoPE sees it."""

    offset: int
    """Prompt index of the item's first token (a video with audio: its `<|audio_bos|>`)."""
    length: int
    """Its tokens in the prompt."""
    kind: str
    """"audio", "image", "video" or "video_audio"."""
    grid_thw: Optional[tuple[int, int, int]] = None
    step: float = 1.0
    """Temporal position step per grid frame (float32 product, truncated per frame)."""
    audio_tokens: int = 0


def chunk_runs(values: Sequence[float], per_chunk: int) -> list[tuple[int, int]]:
    """[start, end) runs of `values` (non-decreasing): a run ends where a value first reaches the next multiple of
    `per_chunk` (one threshold per value, as transformers' get_chunked_index)."""
    runs, start, chunk = [], 0, 1
    for i, value in enumerate(values):
        if value >= chunk * per_chunk:
            runs.append((start, i))
            start, chunk = i, chunk + 1
    runs.append((start, len(values)))
    return runs


def grid_positions(start: int, grid_thw: Sequence[int], merge: int, step: float) -> torch.Tensor:
    """[3, t * h * w / merge**2] positions of a grid starting at `start`."""
    t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    temporal = (torch.arange(t, dtype=torch.float32) * torch.tensor(step, dtype=torch.float32)).long()
    grid = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(grid).reshape(3, -1) + start


def interleaved_positions(start: int, item: OmniItem, merge: int, per_chunk: int) -> torch.Tensor:
    """[3, video + audio tokens] positions of a video with its audio, in their prompt order (chunk by chunk)."""
    video = grid_positions(start, item.grid_thw, merge, item.step)
    audio = (torch.arange(item.audio_tokens) + start).expand(3, -1)
    video_runs = chunk_runs((video[0] - start).tolist(), per_chunk)
    audio_runs = chunk_runs((audio[0] - start).tolist(), per_chunk)
    pieces = []
    for j in range(max(len(video_runs), len(audio_runs))):
        if j < len(video_runs):
            pieces.append(video[:, video_runs[j][0] : video_runs[j][1]])
        if j < len(audio_runs):
            pieces.append(audio[:, audio_runs[j][0] : audio_runs[j][1]])
    return torch.cat(pieces, dim=1)


def omni_mrope_positions(
    prompt_len: int, items: Sequence[OmniItem], merge: int, per_chunk: int
) -> tuple[torch.Tensor, int]:
    """([3, prompt_len] positions, delta for the tokens after the prompt)."""
    pieces: list[torch.Tensor] = []
    index, next_position = 0, 0
    for item in sorted(items, key=lambda i: i.offset):
        if item.offset < index:
            raise ValueError(f"An item at {item.offset} overlaps the item before it (ending at {index})")
        text = item.offset - index
        pieces.append(torch.arange(text).expand(3, -1) + next_position)
        next_position += text
        if item.kind == "audio":
            block = (torch.arange(item.length) + next_position).expand(3, -1)
            following = next_position + item.length
        elif item.kind == "video_audio":  # <|audio_bos|> shares the position of the <|vision_bos|> before it
            shared = next_position - 1
            body = interleaved_positions(shared + 1, item, merge, per_chunk)
            end = int(body.max()) + 1
            block = torch.cat([torch.full((3, 1), shared), body, torch.full((3, 1), end)], dim=1)
            following = end  # <|vision_eos|> after it shares the position of <|audio_eos|>
        else:
            block = grid_positions(next_position, item.grid_thw, merge, item.step)
            following = int(block.max()) + 1
        if block.shape[1] != item.length:
            raise ValueError(f"A {item.kind} item spans {item.length} tokens but its grid gives {block.shape[1]}")
        pieces.append(block)
        index, next_position = item.offset + item.length, following
    if index > prompt_len:
        raise ValueError(f"Items run to token {index}, past the prompt's {prompt_len} tokens")
    pieces.append(torch.arange(prompt_len - index).expand(3, -1) + next_position)
    positions = torch.cat(pieces, dim=1)
    delta = int(positions.max()) + 1 - prompt_len if prompt_len else 0
    return positions, delta
