"""What one forward step tells every attention layer: where its tokens go, what each attends to.

Masks (HF transformers 5.23 semantics, positions absolute within a sequence; a query at p, a key at p'):

- causal:                     p' <= p                                  (`masking_utils.causal_mask_function`)
- sliding window W (a layer): p' > p - W, and-ed over everything else  (`masking_utils.sliding_window_overlay`)
- bidirectional spans:        or p and p' lie in the same span         (`masking_utils.blockwise_overlay`)

so a layer with window W allows `(p' > p - W) & ((p' <= p) | same_span(p, p'))` and a layer without one
`(p' <= p) | same_span(p, p')`, as Gemma 3 composes them (`models/gemma3/modeling_gemma3.py`,
`create_masks_for_vision_model`: full = OR(causal, blockwise); sliding = AND(sliding_window, OR(causal,
blockwise))). The metadata is shared by all layers of a step; masks depend on the layer's window, so
they are built on first use for each window and reused by every layer with that window.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch


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
    """Per sequence, the blocks holding its context, in order. With a window on every layer, the
    engine may have released blocks no query of the step sees (engine/core/block_manager.py): their
    entries are a placeholder, never gathered (windowed paths start at the first visible key)."""

    decode_rows: torch.Tensor
    """[num_decode] batch rows of the sequences with a single new token, attended in one batch."""

    decode_block_tables: torch.Tensor
    """[num_decode, max_blocks] their block tables, padded with block 0."""

    decode_mask: torch.Tensor
    """[num_decode, max_blocks * block_size] True where a cache position holds one of their tokens."""

    bidirectional_spans: list[list[tuple[int, int]]] = field(default_factory=list)
    """Per sequence, the [start, end) spans that change what this step's queries see (spans with a
    token after some query of the step); empty lists (or no lists) for plain causal attention."""

    state_slots: Optional[list[int]] = None
    """Per sequence, its row in the state tensors of the model's non-attention layers (hybrid models:
    `state_cache.py`); None for attention-only models."""

    state_snapshots: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """Sequence -> [(offset, row)] by offset: its state after its first `offset` new tokens is also written to
    `row`."""

    _masks: dict = field(default_factory=dict, repr=False, compare=False)
    """Masks already built this step, by (what, sequence or None, window)."""

    @staticmethod
    def build(
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        bidirectional_spans: Optional[Sequence[Sequence[tuple[int, int]]]] = None,
        state_slots: Optional[Sequence[int]] = None,
        state_snapshots: Sequence[tuple[int, int, int]] = (),
    ) -> "AttentionMetadata":
        """`bidirectional_spans`: per sequence, [start, end) token positions (absolute, within the
        sequence) whose tokens all see each other (Gemma 3: the tokens of one image). The step's new
        tokens of a sequence may start inside a span (its earlier tokens cached), not end strictly
        inside one: the later tokens would be needed and are not there."""
        context_blocks, slots = [], []
        for query_len, context_len, blocks in zip(query_lens, context_lens, block_tables):
            if query_len > context_len:
                raise ValueError(f"query_len {query_len} exceeds context_len {context_len}")
            if len(blocks) * block_size < context_len:
                raise ValueError(f"{len(blocks)} blocks of {block_size} cannot hold {context_len} tokens")
            context_blocks.append(torch.as_tensor(blocks[: -(-context_len // block_size)], dtype=torch.long).to(device))
            # the new tokens' slots, a run per block (Python: cheaper than tensor ops at decode sizes)
            first = context_len - query_len
            for block in range(first // block_size, -(-context_len // block_size)):
                base = blocks[block] * block_size - block * block_size  # slot of position p: base + p
                slots.extend(
                    range(base + max(first, block * block_size), base + min(context_len, (block + 1) * block_size))
                )
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        decode = [i for i, n in enumerate(query_lens) if n == 1]
        starts = torch.tensor([0, *query_lens]).cumsum(0)
        max_blocks = max((-(-context_lens[i] // block_size) for i in decode), default=0)
        tables = torch.zeros(len(decode), max_blocks, dtype=torch.long)
        if decode:  # block tables padded with block 0, in one tensor
            padded = [list(block_tables[i][: -(-context_lens[i] // block_size)]) for i in decode]
            tables = torch.tensor([table + [0] * (max_blocks - len(table)) for table in padded], dtype=torch.long)
        lens = torch.tensor([context_lens[i] for i in decode], dtype=torch.long)
        mask = torch.arange(max_blocks * block_size)[None, :] < lens[:, None]
        spans = []
        if bidirectional_spans is not None:
            if len(bidirectional_spans) != len(query_lens):
                raise ValueError(f"{len(bidirectional_spans)} span lists for {len(query_lens)} sequences")
            spans = [
                _relevant_spans(seq_spans, context_len - query_len, context_len)
                for seq_spans, query_len, context_len in zip(bidirectional_spans, query_lens, context_lens)
            ]
            if not any(spans):
                spans = []
        return AttentionMetadata(
            list(query_lens),
            list(context_lens),
            slot_mapping,
            context_blocks,
            decode_rows=starts[decode].to(device),
            decode_block_tables=tables.to(device),
            decode_mask=mask.to(device),
            bidirectional_spans=spans,
            state_slots=None if state_slots is None else list(state_slots),
            state_snapshots=_by_sequence(state_snapshots),
        )

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device

    def prefill_mask(
        self, seq: int, sliding_window: Optional[int] = None, *, spans: bool = True
    ) -> tuple[int, Optional[torch.Tensor]]:
        """What the new tokens of sequence `seq` see: `(key_start, mask)`, the first cache position any
        of them sees and a bool `[query_len, context_len - key_start]` mask (True: visible) over the
        keys from there on; `(0, None)` for plain causal attention over the whole context. `spans=False`:
        the sequence's bidirectional spans do not apply (a causal layer of a prefix-LM model)."""
        spans = self.bidirectional_spans[seq] if self.bidirectional_spans and spans else []
        if sliding_window is not None and sliding_window >= self.context_lens[seq]:
            sliding_window = None  # covers every key of every query: no window
        if sliding_window is None and not spans:
            return 0, None
        key = ("prefill", seq, sliding_window, bool(spans))
        if key not in self._masks:
            context_len = self.context_lens[seq]
            query_start = context_len - self.query_lens[seq]
            key_start = 0 if sliding_window is None else max(0, query_start - sliding_window + 1)
            keys = torch.arange(key_start, context_len, device=self.device)
            queries = keys[query_start - key_start :, None]
            mask = keys[None, :] <= queries  # causal
            if spans:
                span_id = torch.full((context_len - key_start,), -1, dtype=torch.long)
                for index, (start, end) in enumerate(spans):
                    span_id[max(start, key_start) - key_start : end - key_start] = index
                span_id = span_id.to(self.device)
                query_span = span_id[query_start - key_start :, None]
                mask |= (query_span == span_id[None, :]) & (query_span >= 0)
            if sliding_window is not None:
                mask &= keys[None, :] > queries - sliding_window
            self._masks[key] = key_start, mask
        return self._masks[key]

    def decode_tables(self, sliding_window: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(block_tables, mask)` for the single-token sequences, as `decode_block_tables` and
        `decode_mask`, with a window: only the blocks that hold a position of the window (a decode
        token is the last of its sequence's context, so no span lies after it)."""
        if sliding_window is None:
            return self.decode_block_tables, self.decode_mask
        key = ("decode", None, sliding_window)
        if key in self._masks:
            return self._masks[key]
        lens = [self.context_lens[i] for i, n in enumerate(self.query_lens) if n == 1]
        if sliding_window >= max(lens, default=0):  # covers every context: no window
            self._masks[key] = self.decode_block_tables, self.decode_mask
        else:
            tables = self.decode_block_tables
            block_size = self.decode_mask.shape[1] // tables.shape[1]
            lens = torch.tensor(lens)
            first = (lens - sliding_window).clamp(min=0) // block_size  # first block holding a visible key
            last = (lens - 1) // block_size
            num_blocks = int((last - first).max()) + 1 if len(lens) else 0
            index = first[:, None] + torch.arange(num_blocks)  # [B, num_blocks], may run past `last`
            positions = (index[:, :, None] * block_size + torch.arange(block_size)).flatten(1)
            mask = (positions < lens[:, None]) & (positions >= lens[:, None] - sliding_window)
            index = torch.minimum(index, last[:, None]).to(tables.device)  # past the end: masked anyway
            self._masks[key] = tables.gather(1, index), mask.to(tables.device)
        return self._masks[key]

    def decode_visible(self, sliding_window: Optional[int] = None) -> list[tuple[int, int]]:
        """Per single-token sequence, the [start, end) of its visible keys among the positions of its
        `decode_tables(sliding_window)` blocks (Python ints: a lone sequence slices them, no mask)."""
        key = ("visible", None, sliding_window)
        if key not in self._masks:
            tables, mask = self.decode_tables(sliding_window)
            block_size = mask.shape[1] // tables.shape[1] if tables.shape[1] else 1
            lens = [self.context_lens[i] for i, n in enumerate(self.query_lens) if n == 1]
            windowed = tables is not self.decode_block_tables
            visible = []
            for length in lens:
                start = max(length - sliding_window, 0) if windowed else 0
                skip = start // block_size * block_size if windowed else 0  # the blocks before the first gathered
                visible.append((start - skip, length - skip))
            self._masks[key] = visible
        return self._masks[key]


def _by_sequence(snapshots: Sequence[tuple[int, int, int]]) -> dict[int, list[tuple[int, int]]]:
    by_sequence: dict[int, list[tuple[int, int]]] = {}
    for seq, offset, row in sorted(snapshots):
        by_sequence.setdefault(seq, []).append((offset, row))
    return by_sequence


def _relevant_spans(spans: Sequence[tuple[int, int]], query_start: int, context_len: int) -> list[tuple[int, int]]:
    """The spans of one sequence in which a query of this step has a later span-mate: the only ones
    that change its mask (an earlier span-mate is visible already by causality)."""
    relevant, previous_end = [], None
    for start, end in sorted((int(s), int(e)) for s, e in spans):
        if not 0 <= start < end:
            raise ValueError(f"bidirectional span [{start}, {end}) is not a non-empty range of positions")
        if previous_end is not None and start < previous_end:
            raise ValueError(f"bidirectional spans overlap at [{start}, {previous_end})")
        previous_end = end
        if start < context_len < end:
            raise ValueError(
                f"the step's tokens end at {context_len}, inside bidirectional span [{start}, {end}): "
                "its later tokens would have to be in the same step"
            )
        if end <= context_len and max(start, query_start) < end - 1:
            relevant.append((start, end))
    return relevant


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
