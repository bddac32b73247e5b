"""Three-axis M-RoPE positions of a prompt, as Qwen2-VL / Qwen2.5-VL / Qwen3-VL compute them.

Text tokens get one index on all three axes (temporal, height, width), counting on from the
previous token. The tokens of an image or video get (t * time_interval, h, w) over its merged patch
grid, offset by the position where the item starts; the text after it continues from that start
plus max(h, w) (transformers 5's `get_rope_index`). Decoding continues 1-D from the prompt: token
i (i >= prompt length) sits at i + delta on every axis, delta = max prompt position + 1 - length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionGrid:
    """One image or video of a prompt, as M-RoPE sees it."""

    offset: int
    """Prompt index of the item's first embedding token (its patch tokens run on from there)."""

    grid_thw: tuple[int, int, int]
    """Patch grid before the spatial merge (the processor's image_grid_thw / video_grid_thw row)."""

    time_interval: float = 1.0
    """Temporal position step per grid frame (Qwen2.5-VL video: tokens_per_second * seconds per frame)."""


def vision_position_ids(
    start: int, grid_thw: Sequence[int], spatial_merge_size: int, time_interval: float = 1.0
) -> torch.Tensor:
    """[3, t * h * w / merge**2] positions of one item whose first token sits at position `start`."""
    t, h, w = grid_thw[0], grid_thw[1] // spatial_merge_size, grid_thw[2] // spatial_merge_size
    temporal = (torch.arange(t) * time_interval).long() + start
    grid = torch.meshgrid(temporal, torch.arange(h) + start, torch.arange(w) + start, indexing="ij")
    return torch.stack(grid).reshape(3, -1)


def mrope_input_positions(
    prompt_len: int, grids: Sequence[VisionGrid], spatial_merge_size: int
) -> tuple[torch.Tensor, int]:
    """([3, prompt_len] positions of the prompt, delta for the tokens after it)."""
    pieces, index, position = [], 0, 0
    for grid in sorted(grids, key=lambda g: g.offset):
        if grid.offset < index:
            raise ValueError(f"Vision item at {grid.offset} overlaps the item before it (ending at {index})")
        text_len = grid.offset - index
        pieces.append(torch.arange(text_len).expand(3, -1) + position)
        position += text_len
        vision = vision_position_ids(position, grid.grid_thw, spatial_merge_size, grid.time_interval)
        pieces.append(vision)
        index = grid.offset + vision.shape[1]
        position += max(grid.grid_thw[1], grid.grid_thw[2]) // spatial_merge_size
    if index > prompt_len:
        raise ValueError(f"Vision items run to token {index}, past the prompt's {prompt_len} tokens")
    pieces.append(torch.arange(prompt_len - index).expand(3, -1) + position)
    positions = torch.cat(pieces, dim=1)
    delta = int(positions.max()) + 1 - prompt_len if prompt_len else 0
    return positions, delta


def decode_positions(start: int, end: int, delta: int) -> torch.Tensor:
    """[3, end - start] positions of tokens start..end-1 after the prompt."""
    return (torch.arange(start, end) + delta).expand(3, -1)
