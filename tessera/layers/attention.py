"""Causal self-attention over a paged KV cache.

The cache of each layer is a pool of fixed-size blocks, `[num_blocks, block_size, kv_heads,
head_dim]` for keys and for values. A sequence owns a list of blocks (its block table); token t of
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

    context_slots: list[torch.Tensor]
    """Per sequence, [context_len] slots of all its tokens, in order."""

    @staticmethod
    def build(
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        context_slots, new_slots = [], []
        for query_len, context_len, blocks in zip(query_lens, context_lens, block_tables):
            if query_len > context_len:
                raise ValueError(f"query_len {query_len} exceeds context_len {context_len}")
            if len(blocks) * block_size < context_len:
                raise ValueError(f"{len(blocks)} blocks of {block_size} cannot hold {context_len} tokens")
            positions = torch.arange(context_len)
            slots = torch.as_tensor(blocks, dtype=torch.long)[positions // block_size] * block_size + (
                positions % block_size
            )
            context_slots.append(slots.to(device))
            new_slots.append(slots[context_len - query_len :])
        slot_mapping = torch.cat(new_slots).to(device) if new_slots else torch.empty(0, dtype=torch.long)
        return AttentionMetadata(list(query_lens), list(context_lens), slot_mapping, context_slots)

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
        # Bound by the runner (see kv_cache.py): [num_blocks, block_size, num_kv_heads, head_dim].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] -> [T, H, D]."""
        metadata = get_attention_metadata()
        if self.k_cache.numel() == 0:
            raise RuntimeError("The KV cache is not allocated; call allocate_kv_cache(model, ...) first")
        k_cache = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)  # [num_slots, Hkv, D]
        v_cache = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_cache.index_copy_(0, metadata.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, metadata.slot_mapping, v.to(v_cache.dtype))

        out = torch.empty_like(q)
        start = 0
        for query_len, context_len, slots in zip(metadata.query_lens, metadata.context_lens, metadata.context_slots):
            q_seq = q[start : start + query_len].transpose(0, 1)  # [H, q, D]
            k_seq = k_cache[slots].transpose(0, 1).to(q.dtype)  # [Hkv, ctx, D]
            v_seq = v_cache[slots].transpose(0, 1).to(q.dtype)
            # Query j sits at position context_len - query_len + j and sees keys up to it.
            mask = None
            if query_len > 1:
                mask = torch.ones(query_len, context_len, dtype=torch.bool, device=q.device).tril(
                    diagonal=context_len - query_len
                )
            o = F.scaled_dot_product_attention(
                q_seq, k_seq, v_seq, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
            )
            out[start : start + query_len] = o.transpose(0, 1)
            start += query_len
        return out
