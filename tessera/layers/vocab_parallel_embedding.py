"""The token embedding and the language-model head split over the tensor-parallel ranks by vocabulary
rows (vLLM's layers of the same names).

Each rank holds ceil(vocab / ranks) consecutive rows (the last rank's tail zero-padded). The embedding
looks up the ids in its rows (zero for the others) and sums over the ranks; the head computes its rows'
logits and gathers every rank's, cut back to the vocabulary. With one rank both are the plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import get_tp_group
from .linear import Linear


def _vocab_rows(vocab_size: int) -> tuple[int, int]:
    """(rows per rank, this rank's first row)."""
    tp = get_tp_group()
    per_rank = -(-vocab_size // tp.world_size)
    return per_rank, per_rank * tp.rank


def _shard_vocab(tensor: torch.Tensor, start: int, per_rank: int) -> torch.Tensor:
    """A checkpoint [vocab, ...] tensor -> this rank's rows, zero-padded to `per_rank`."""
    rows = tensor[start : start + per_rank]
    if rows.shape[0] == per_rank:
        return rows
    padded = torch.zeros((per_rank, *tensor.shape[1:]), dtype=tensor.dtype)
    padded[: rows.shape[0]] = rows
    return padded


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        self.tp = get_tp_group()
        self.vocab_size = num_embeddings
        self.rows_per_rank, self.vocab_start = _vocab_rows(num_embeddings)
        super().__init__(self.rows_per_rank, embedding_dim)

    def shard_weight(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        return _shard_vocab(tensor, self.vocab_start, self.rows_per_rank) if self.tp.world_size > 1 else tensor

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] ids -> [T, dim]."""
        if self.tp.world_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        out = out.masked_fill_(~mine.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(Linear):
    def __init__(self, hidden_size: int, vocab_size: int, bias: bool = False) -> None:
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        self.rows_per_rank, self.vocab_start = _vocab_rows(vocab_size)
        super().__init__(hidden_size, self.rows_per_rank, bias=bias)

    def shard_weight(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        return _shard_vocab(tensor, self.vocab_start, self.rows_per_rank) if self.tp.world_size > 1 else tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] logits (every rank's rows gathered)."""
        logits = super().forward(x)
        if self.tp.world_size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[..., : self.vocab_size]
