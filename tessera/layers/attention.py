"""Causal self-attention over a paged KV cache.

The cache of each layer is a pool of fixed-size blocks, `[num_blocks, kv_heads, block_size,
head_dim]` for keys and for values (heads outside positions, so decode attention can multiply
gathered blocks without reordering them). A sequence owns a list of blocks (its block table); token t of
a sequence lives in slot `block_table[t // block_size] * block_size + t % block_size`. One forward
step carries new tokens of several sequences, flattened into one `[num_tokens, ...]` batch: whole
prompts, prompt chunks whose earlier tokens are already cached, and single decode tokens alike.
The engine's scheduler decides what runs; `AttentionMetadata` tells each layer where things are.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """Where the tokens of one forward step go in the KV cache, and what each attends to."""

    query_lens: list[int]
    """New tokens of each sequence in this step (their queries are contiguous in the batch)."""

    context_lens: list[int]
    """Tokens of each sequence in the cache after this step (cached prefix + new tokens)."""

    slot_mapping: torch.Tensor
    """[num_tokens] cache slot of each new token."""

    context_blocks: list[torch.Tensor]
    """Per sequence, the blocks holding its context, in order."""

    decode_rows: torch.Tensor
    """[num_decode] batch rows of the sequences with a single new token, attended in one batch."""

    decode_block_tables: torch.Tensor
    """[num_decode, max_blocks] their block tables, padded with block 0."""

    decode_mask: torch.Tensor
    """[num_decode, max_blocks * block_size] True where a cache position holds one of their tokens."""

    @staticmethod
    def build(
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        context_blocks, new_slots = [], []
        for query_len, context_len, blocks in zip(query_lens, context_lens, block_tables):
            if query_len > context_len:
                raise ValueError(f"query_len {query_len} exceeds context_len {context_len}")
            if len(blocks) * block_size < context_len:
                raise ValueError(f"{len(blocks)} blocks of {block_size} cannot hold {context_len} tokens")
            positions = torch.arange(context_len)
            slots = torch.as_tensor(blocks, dtype=torch.long)[positions // block_size] * block_size + (
                positions % block_size
            )
            context_blocks.append(torch.as_tensor(blocks[: -(-context_len // block_size)], dtype=torch.long).to(device))
            new_slots.append(slots[context_len - query_len :])
        slot_mapping = torch.cat(new_slots).to(device) if new_slots else torch.empty(0, dtype=torch.long)
        decode = [i for i, n in enumerate(query_lens) if n == 1]
        starts = torch.tensor([0, *query_lens]).cumsum(0)
        max_blocks = max((-(-context_lens[i] // block_size) for i in decode), default=0)
        tables = torch.zeros(len(decode), max_blocks, dtype=torch.long)
        for row, i in enumerate(decode):
            used = -(-context_lens[i] // block_size)
            tables[row, :used] = torch.as_tensor(block_tables[i][:used])
        lens = torch.tensor([context_lens[i] for i in decode], dtype=torch.long)
        mask = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]
        return AttentionMetadata(
            list(query_lens),
            list(context_lens),
            slot_mapping,
            context_blocks,
            decode_rows=starts[decode].to(device),
            decode_block_tables=tables.to(device),
            decode_mask=mask.to(device),
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


_metadata: Optional[AttentionMetadata] = None


@contextmanager
def attention_metadata(metadata: AttentionMetadata) -> Iterator[None]:
    """Makes `metadata` visible to every attention layer during one forward step."""
    global _metadata
    previous, _metadata = _metadata, metadata
    try:
        yield
    finally:
        _metadata = previous


def get_attention_metadata() -> AttentionMetadata:
    if _metadata is None:
        raise RuntimeError("No attention metadata: run the model inside `with attention_metadata(...)`")
    return _metadata


class PagedAttention(nn.Module):
    """Stores the step's keys/values in the cache, then attends each sequence over its context."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        # Bound by the runner (see kv_cache.py): [num_blocks, num_kv_heads, block_size, head_dim].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] -> [T, H, D]."""
        metadata = get_attention_metadata()
        if self.k_cache.numel() == 0:
            raise RuntimeError("The KV cache is not allocated; call allocate_kv_cache(model, ...) first")
        block_size = self.k_cache.shape[2]
        blocks, offsets = metadata.slot_mapping // block_size, metadata.slot_mapping % block_size
        self.k_cache[blocks, :, offsets] = k.to(self.k_cache.dtype)
        self.v_cache[blocks, :, offsets] = v.to(self.v_cache.dtype)

        if len(metadata.decode_rows) == q.shape[0]:  # a pure decode step
            return self._decode(q, metadata)
        out = torch.empty_like(q)
        if len(metadata.decode_rows):
            out[metadata.decode_rows] = self._decode(q[metadata.decode_rows], metadata)
        start = 0
        for query_len, context_len, blocks in zip(metadata.query_lens, metadata.context_lens, metadata.context_blocks):
            if query_len > 1:
                out[start : start + query_len] = self._prefill(q[start : start + query_len], blocks, context_len)
            start += query_len
        return out

    def _prefill(self, q: torch.Tensor, blocks: torch.Tensor, context_len: int) -> torch.Tensor:
        """One sequence's chunk: q [n, H, D] over its context of `context_len` tokens -> [n, H, D]."""
        group = self.num_heads // self.num_kv_heads
        # [blocks, Hkv, block_size, D] -> [H, ctx, D]; kv heads repeated: SDPA's enable_gqa path is slow on CPU
        k, v = (
            cache.index_select(0, blocks).transpose(0, 1).flatten(1, 2)[:, :context_len]
            .to(q.dtype).repeat_interleave(group, dim=0)
            for cache in (self.k_cache, self.v_cache)
        )  # fmt: skip
        query_len = q.shape[0]
        if query_len == context_len:  # a whole prompt: the fused causal kernel, no mask tensor
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=self.scale)
            return out.transpose(0, 1)
        # A chunk after cached tokens: query j sits at position context_len - query_len + j.
        mask = torch.ones(query_len, context_len, dtype=torch.bool, device=q.device).tril(context_len - query_len)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=self.scale)
        return out.transpose(0, 1)

    def _decode(self, q: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """All single-token sequences at once, block by block: q [B, H, D] -> [B, H, D]."""
        batch, group = q.shape[0], self.num_heads // self.num_kv_heads
        tables = metadata.decode_block_tables
        num_blocks, block_size = tables.shape[1], self.k_cache.shape[2]
        # index_select: several times faster than advanced indexing on CPU
        k, v = (
            cache.index_select(0, tables.flatten()).view(batch, num_blocks, *cache.shape[1:]).to(q.dtype)
            for cache in (self.k_cache, self.v_cache)
        )  # [B, blocks, Hkv, block_size, D]
        q = q.view(batch, 1, self.num_kv_heads, group, self.head_dim)  # heads of a kv group are adjacent
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale  # [B, blocks, Hkv, group, block_size]
        mask = metadata.decode_mask.view(batch, num_blocks, 1, 1, block_size)
        scores = scores.masked_fill(~mask, float("-inf"))
        # softmax over every position of the sequence: blocks and offsets together
        scores = scores.permute(0, 2, 3, 1, 4).reshape(batch, self.num_kv_heads, group, -1).softmax(dim=-1)
        probs = scores.view(batch, self.num_kv_heads, group, num_blocks, block_size).permute(0, 3, 1, 2, 4)
        out = torch.matmul(probs, v).sum(dim=1)  # [B, Hkv, group, D]
        return out.reshape(batch, self.num_heads, self.head_dim)
