"""Linear layers that fuse several checkpoint projections into one matmul.

q/k/v (and gate/up) read the same input; one wide matmul is faster than three narrow ones,
especially for the few rows of a decode step. The loader fills each shard from the checkpoint
tensor named after it (e.g. `q_proj.weight` into rows [0, q) of `qkv_proj.weight`).
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        """`shards`: checkpoint name of each projection (a sibling of this module) -> output width."""
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)

    def shard_rows(self) -> dict[str, slice]:
        rows, start = {}, 0
        for name, width in self.shards.items():
            rows[name] = slice(start, start + width)
            start += width
        return rows

    def split(self, output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[..., sum(widths)] -> one tensor per shard, in order."""
        return output.split(list(self.shards.values()), dim=-1)
