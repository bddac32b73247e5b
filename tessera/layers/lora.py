"""LoRA adapters on the language model's linears, chosen per request: a step may mix requests of several adapters
and of none, so each adapted Linear adds, for the rows of each adapter in the step, `scale * (x @ A.T) @ B.T` to
its output (to the output rows of the projection the adapter targets: q, k or v of a fused qkv, gate or up of a
fused gate_up). The rows of one adapter go through one pair of matmuls (grouped, as punica's kernels do); rows of
no adapter cost nothing.

`lora_rows(ids)` tells the step which adapter each token row belongs to (0: none); `LoRAWeights` on a Linear hold
each loaded adapter's A, B, scale and target rows. The native decode layer (models/native_decode.py) fuses the
whole layer, so a step with any adapted row runs the eager modules.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Union

import torch

# the running step's rows of each adapter ({id: row indices}, found once per step, not per layer), or one id for all
_rows: Union[dict[int, torch.Tensor], int, None] = None


@contextmanager
def lora_rows(ids: Union[torch.Tensor, int, None]) -> Iterator[None]:
    """Run a step whose token rows belong to these adapters ([T] ids, 0 for none; None: no adapter at all), or
    whose every row belongs to one adapter (an int: an encoder run for the items of one adapter's requests)."""
    global _rows
    groups: Union[dict[int, torch.Tensor], int, None] = (ids or None) if isinstance(ids, int) else None
    if isinstance(ids, torch.Tensor) and bool(ids.any()):
        groups = {a: (ids == a).nonzero().squeeze(1) for a in torch.unique(ids).tolist() if a != 0}
    previous, _rows = _rows, groups
    try:
        yield
    finally:
        _rows = previous


def lora_active() -> bool:
    """Whether some row of the running step has an adapter."""
    return _rows is not None


@dataclass
class LoRAPart:
    """One adapter's low-rank update of some of a Linear's output rows: out[:, rows] += scale * x @ A.T @ B.T."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [len(rows), r]
    scale: float
    rows: slice


def apply_lora(x: torch.Tensor, out: torch.Tensor, parts: dict[int, list[LoRAPart]]) -> torch.Tensor:
    """`out` [T, out_features] (the base layer's, for `x` [T, in]) with each adapter's update on its rows."""
    if _rows is None or not parts:
        return out
    flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
    if isinstance(_rows, int):  # every row: one adapter's encoder run
        for part in parts.get(_rows, []):
            delta = (flat_x @ part.a.T.to(flat_x.dtype)) @ part.b.T.to(flat_x.dtype)
            flat_out[:, part.rows] += (delta * part.scale).to(flat_out.dtype)
        return out
    for adapter, rows in _rows.items():
        if adapter not in parts:
            continue
        xs = flat_x[rows]
        for part in parts[adapter]:
            delta = (xs @ part.a.T.to(xs.dtype)) @ part.b.T.to(xs.dtype)
            flat_out[rows, part.rows] += (delta * part.scale).to(flat_out.dtype)
    return out
