"""Causal self-attention over a paged KV cache.

The cache of each layer is a pool of fixed-size blocks, `[num_blocks, block_size, kv_heads,
head_dim]` for keys and for values: slot-major, so the step's keys and values are written with one
`index_copy_` into the flat `[num_slots, kv_heads, head_dim]` view, and a sequence's gathered blocks
are its context in order, `[context, kv_heads, head_dim]`, with no copy. A sequence owns a list of
blocks (its block table); token t of a sequence lives in slot `block_table[t // block_size] *
block_size + t % block_size`. One forward
step carries new tokens of several sequences, flattened into one `[num_tokens, ...]` batch: whole
prompts, prompt chunks whose earlier tokens are already cached, and single decode tokens alike.
The engine's scheduler decides what runs; `AttentionMetadata` (attention_metadata.py) tells each
layer where things are. Per layer: an optional sliding window, logit soft-capping; per sequence
(in the metadata): bidirectional spans. Masks follow HF transformers 5.23, see attention_metadata.py.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .attention_metadata import AttentionMetadata, attention_metadata, get_attention_metadata

__all__ = ["AttentionMetadata", "PagedAttention", "attention_metadata", "get_attention_metadata"]


class PagedAttention(nn.Module):
    """Stores the step's keys/values in the cache, then attends each sequence over its context.

    `sliding_window`: a query at position p sees keys at p' > p - sliding_window only (HF's
    `sliding_window_overlay`; 1 = itself only). `logits_soft_cap`: scores become
    `cap * tanh(scores / cap)` after scaling, before masking and softmax (HF Gemma 2's eager
    attention). Bidirectional spans come per sequence with the step's `AttentionMetadata`; a layer honours
    them (and-ed with its window, as HF Gemma 3 does) unless built with `bidirectional_spans=False` (Gemma 4's
    full-attention layers stay causal).

    `reads_kv_of`: a layer that shares another layer's cache (Gemma 4's KV-shared layers) attends over the keys
    and values that layer wrote and writes none; the allocator binds it to that layer's cache (kv_cache.py).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        *,
        sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None,
        bidirectional_spans: bool = True,
        reads_kv_of: Optional["PagedAttention"] = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}")
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.sliding_window, self.logits_soft_cap = sliding_window, logits_soft_cap
        self.bidirectional_spans = bidirectional_spans
        if reads_kv_of is not None and (reads_kv_of.num_kv_heads, reads_kv_of.head_dim) != (num_kv_heads, head_dim):
            raise ValueError("A layer that reads another layer's KV cache must have its kv heads and head_dim")
        self.kv_source: tuple[PagedAttention, ...] = (reads_kv_of,) if reads_kv_of is not None else ()
        """The layer whose cache this one reads (a tuple: not registered as a submodule)."""
        # Bound by the runner (see kv_cache.py): `cache_shape` each.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """The shape of this layer's key (and value) cache: [num_blocks, block_size, kv_heads, head_dim]."""
        return num_blocks, block_size, self.num_kv_heads, self.head_dim

    def extra_repr(self) -> str:
        extra = f"num_heads={self.num_heads}, head_dim={self.head_dim}, num_kv_heads={self.num_kv_heads}"
        if self.sliding_window is not None:
            extra += f", sliding_window={self.sliding_window}"
        if self.logits_soft_cap is not None:
            extra += f", logits_soft_cap={self.logits_soft_cap}"
        if self.kv_source:
            extra += ", reads another layer's KV cache"
        return extra

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor]) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] (None for a layer that reads another's cache) -> [T, H, D]."""
        metadata = get_attention_metadata()
        if self.k_cache.numel() == 0:
            raise RuntimeError("The KV cache is not allocated; call allocate_kv_cache(model, ...) first")
        if (k is None) != bool(self.kv_source):
            raise ValueError("A layer writes its keys and values unless it reads another layer's cache")
        if k is not None:
            for cache, new in ((self.k_cache, k), (self.v_cache, v)):  # [num_slots, Hkv, D] views
                flat = cache.view(-1, self.num_kv_heads, self.head_dim)
                flat.index_copy_(0, metadata.slot_mapping, new.to(cache.dtype))

        if len(metadata.decode_rows) == q.shape[0]:  # a pure decode step
            return self._decode(q, metadata)
        out = torch.empty_like(q)
        if len(metadata.decode_rows):
            out[metadata.decode_rows] = self._decode(q[metadata.decode_rows], metadata)
        spans = self.bidirectional_spans and bool(metadata.bidirectional_spans)
        plain = self.sliding_window is None and self.logits_soft_cap is None and not spans
        start = 0
        for seq, (query_len, context_len, blocks) in enumerate(
            zip(metadata.query_lens, metadata.context_lens, metadata.context_blocks)
        ):
            if query_len > 1:
                if plain:
                    out[start : start + query_len] = self._prefill(q[start : start + query_len], blocks, context_len)
                else:
                    key_start, mask = metadata.prefill_mask(seq, self.sliding_window, spans=self.bidirectional_spans)
                    out[start : start + query_len] = self._prefill_masked(
                        q[start : start + query_len], blocks, context_len, key_start, mask
                    )
            start += query_len
        return out

    def _gather(self, blocks: torch.Tensor, start: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Keys and values at context positions start..end-1 of the sequence holding `blocks`, kv heads
        repeated to the query heads (SDPA's enable_gqa path is slow on CPU): two [H, end - start, D]."""
        group = self.num_heads // self.num_kv_heads
        return tuple(
            cache.index_select(0, blocks).flatten(0, 1)[start:end].transpose(0, 1).to(dtype)
            .repeat_interleave(group, dim=0)
            for cache in (self.k_cache, self.v_cache)
        )  # fmt: skip

    def _prefill(self, q: torch.Tensor, blocks: torch.Tensor, context_len: int) -> torch.Tensor:
        """One sequence's chunk: q [n, H, D] over its context of `context_len` tokens -> [n, H, D]."""
        k, v = self._gather(blocks, 0, context_len, q.dtype)
        query_len = q.shape[0]
        if query_len == context_len:  # a whole prompt: the fused causal kernel, no mask tensor
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True, scale=self.scale)
            return out.transpose(0, 1)
        # A chunk after cached tokens: query j sits at position context_len - query_len + j.
        mask = torch.ones(query_len, context_len, dtype=torch.bool, device=q.device).tril(context_len - query_len)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=self.scale)
        return out.transpose(0, 1)

    def _prefill_masked(
        self, q: torch.Tensor, blocks: torch.Tensor, context_len: int, key_start: int, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """`_prefill` with a window, spans or soft-capping: q [n, H, D] over the keys from position
        `key_start` on, `mask` [n, context_len - key_start] (None: causal) -> [n, H, D]."""
        if mask is None and self.logits_soft_cap is None:
            return self._prefill(q, blocks, context_len)
        block_size = self.k_cache.shape[1]
        first_block = key_start // block_size  # gather only the blocks holding a visible key
        skip = first_block * block_size
        k, v = self._gather(blocks[first_block:], key_start - skip, context_len - skip, q.dtype)
        query_len = q.shape[0]
        if mask is None:  # causal, only soft-capped
            mask = torch.ones(query_len, context_len, dtype=torch.bool, device=q.device).tril(context_len - query_len)
        q = q.transpose(0, 1)  # [H, n, D]
        if self.logits_soft_cap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale).transpose(0, 1)
        # SDPA has no soft-capping: scores by hand, a bounded number of query rows at a time
        out = torch.empty_like(q)
        rows = max(1, (1 << 24) // (self.num_heads * k.shape[1]))
        for row in range(0, query_len, rows):
            out[:, row : row + rows] = self._soft_capped(q[:, row : row + rows], k, v, mask[row : row + rows])
        return out.transpose(0, 1)

    def _soft_capped(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """Attention with logit soft-capping, which SDPA lacks: q [..., n, D] over k, v [..., L, D] with a
        bool `mask` broadcasting to [..., n, L] (True: visible; None: all) -> [..., n, D]."""
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v)

    def _decode(self, q: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """All single-token sequences at once: q [B, H, D] -> [B, H, D]. The `group` query heads sharing
        a kv head are that head's `group` query rows (one position: no causal mask), so SDPA runs on
        the gathered cache as it lies, [B, Hkv, L, D] strided, with no copy per query head."""
        batch, group = q.shape[0], self.num_heads // self.num_kv_heads
        tables, mask = metadata.decode_tables(self.sliding_window)  # [B, blocks], [B, L]
        k, v = (
            cache.index_select(0, tables.flatten()).view(batch, -1, self.num_kv_heads, self.head_dim)
            .transpose(1, 2).to(q.dtype)
            for cache in (self.k_cache, self.v_cache)
        )  # fmt: skip  # [B, Hkv, L, D]
        q = q.view(batch, self.num_kv_heads, group, self.head_dim)  # heads of a kv group are adjacent
        mask = mask.view(batch, 1, 1, -1)
        if batch == 1:  # one sequence: its visible keys are a contiguous run, no mask needed
            start, end = metadata.decode_visible(self.sliding_window)[0]
            k, v, mask = k[:, :, start:end], v[:, :, start:end], None
        if self.logits_soft_cap is not None:
            out = self._soft_capped(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.reshape(batch, self.num_heads, self.head_dim)
