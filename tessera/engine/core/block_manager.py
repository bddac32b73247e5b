"""Paged KV-cache blocks: ref-counted, handed to requests, reused across identical prefixes.

A full block is identified by a hash chained over its parent's hash, its tokens and the content
hashes of the images whose placeholders overlap it: two prompts with the same tokens but other
images never share a block, and a repeated image + prompt finds its blocks again. Freed blocks
keep their hash and stay reusable until they are evicted, least recently freed first.

When every attention layer of the model has a sliding window, the blocks of a sequence that fell
out of every window are released while it runs (`release_before`): they leave its block table's
live part but keep their place in it as `PLACEHOLDER`, so token t still lives in block t // block_size.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import numpy as np
from blake3 import blake3

from .request import Request
from .state_slots import StateSlots

PLACEHOLDER = 0
"""Block id standing for a released block in a block table: a valid index (block tables become
tensors) that attention never reads. Blocks are released only before n - W + 1 (n computed tokens,
W the largest window), and a windowed layer gathers only from its window's first visible key on
(`AttentionMetadata.prefill_mask`'s key_start, `decode_tables`); the whole tables
(`context_blocks`, `decode_block_tables`) are gathered only when the window covers every key, when
nothing was released. New tokens are written at positions >= n, in live blocks."""


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
        states: Optional[StateSlots] = None,
    ) -> None:  # fmt: skip
        """`states`: for a hybrid model, the rows of its layers' state (`state_slots.py`): a request holds one
        from its first allocation until it is freed (finished, aborted or preempted), and a cached prefix is
        used up to its last snapshot."""
        if num_blocks < 1:
            raise ValueError(f"The KV cache needs at least one block, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.states = states
        self.reset()

    def reset(self) -> None:
        """Every block free and uncached, no request, counters at zero."""
        num_blocks = self.num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[Optional[bytes]] = [None] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # eviction order
        self.cached_blocks: dict[bytes, int] = {}  # hash -> block holding it
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}  # hashes of each request's full blocks
        self.req_released: dict[str, int] = {}  # leading blocks of each request already released
        self.prefix_queries = self.prefix_hits = 0  # in tokens
        self.req_restores: dict[str, int] = {}  # request id -> the snapshot row its cached prefix ends at
        self.req_output_snapshots: dict[str, bytes] = {}  # request id -> the block of its latest output snapshot
        if self.states is not None:
            self.states.reset()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_of(self, request: Request) -> list[int]:
        """The request's block table: `PLACEHOLDER` for each released block, then its live blocks."""
        return self.req_blocks.get(request.request_id, [])

    def state_slot_of(self, request: Request) -> int:
        """The request's row in the state of a hybrid model's non-attention layers."""
        return self.states.slot_of(request.request_id)

    def live_blocks_of(self, request: Request) -> list[int]:
        """The blocks the request holds (its table without the released ones)."""
        return self.blocks_of(request)[self.req_released.get(request.request_id, 0) :]

    # ---- prefix caching -----------------------------------------------------------------------

    def block_hashes_of(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks, extended as its tokens grow."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        while (len(hashes) + 1) * self.block_size <= len(tokens):
            start = len(hashes) * self.block_size
            end = start + self.block_size
            hasher = blake3(hashes[-1] if hashes else _first_block_seed(request))
            hasher.update(np.asarray(tokens[start:end], dtype=np.int64).tobytes())
            for item in request.items_overlapping(start, end):
                hasher.update(f"|{item.hash}@{item.start - start}".encode())
            hashes.append(hasher.digest())
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding the longest cached prefix of the request. At least one token is
        left to compute: its logits are needed to sample."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        hashes = self.block_hashes_of(request)
        for block_hash in hashes[:max_blocks]:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        if self.states is not None:  # a hybrid model: only as far as a snapshot of its state reaches
            usable, row = self.states.usable_prefix(hashes, len(blocks))
            blocks = blocks[:usable]
            self.req_restores.pop(request.request_id, None)
            if row is not None:
                self.req_restores[request.request_id] = row
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(blocks) * self.block_size
        return blocks

    # ---- allocation ---------------------------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int, cached_prefix: list[int] = ()) -> bool:  # type: ignore[assignment]
        """Give the request blocks for `num_new_tokens` more tokens (after taking `cached_prefix`);
        False, changing nothing, when there are not enough free blocks."""
        blocks = self.req_blocks.get(request.request_id, [])
        reusable = [b for b in cached_prefix if self.ref_counts[b] == 0]  # counted as free now
        num_tokens = request.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        needed = -(-num_tokens // self.block_size) - len(blocks) - len(cached_prefix)
        if needed > self.num_free_blocks - len(reusable):
            return False
        if self.states is not None and not self.states.take(request.request_id):
            return False
        for block in cached_prefix:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        new_blocks = [self._take_free_block() for _ in range(max(needed, 0))]
        self.req_blocks[request.request_id] = blocks + list(cached_prefix) + new_blocks
        return True

    def take_state_restore(self, request: Request) -> Optional[int]:
        """The snapshot row that the request's cached prefix (just allocated) ends at, once; None if none."""
        return self.req_restores.pop(request.request_id, None)

    def snapshot_boundaries(self, request: Request, start: int, num_new: int) -> list[int]:
        """Hybrid models with prefix caching: the block boundaries within tokens start + 1 .. start + num_new where
        the request's state is to be kept as a snapshot (none with one already): the last boundary at or before
        each image's end (another question about the image shares the prefix up to there), the last before the
        prompt's last token (a later prompt reusing it has a token left to compute), and in the output every
        block's end (the next turn of a chat starts with this one's answer)."""
        if self.states is None or not self.states.num_snapshots or not self.enable_prefix_caching:
            return []
        size, end = self.block_size, start + num_new
        candidates = {item.end // size * size for item in request.items_overlapping(start, end + size)}
        candidates.add((request.num_prompt_tokens - 1) // size * size)
        if end > request.num_prompt_tokens:
            candidates.add(end // size * size)
        limit = min(end, len(request.all_token_ids))
        hashes = self.block_hashes_of(request)
        return sorted(
            b for b in candidates
            if start < b <= limit and (b <= request.num_prompt_tokens or b == end // size * size)
            and not self.states.has_snapshot(hashes[b // size - 1])
        )  # fmt: skip

    def publish_snapshot(self, request: Request, end: int, row: int) -> None:
        """The state after the request's first `end` tokens (a block boundary) is in snapshot row `row`. Of the
        snapshots in a request's output only the last is kept: a later prompt can start from it."""
        block_hash = self.block_hashes_of(request)[end // self.block_size - 1]
        self.states.publish(block_hash, row)
        if end > request.num_prompt_tokens:
            previous = self.req_output_snapshots.get(request.request_id)
            if previous is not None and previous != block_hash:
                self.states.drop(previous)
            self.req_output_snapshots[request.request_id] = block_hash

    def _take_free_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        if self.block_hashes[block] is not None:  # evict its cached content
            if self.cached_blocks.get(self.block_hashes[block]) == block:
                del self.cached_blocks[self.block_hashes[block]]
            self.block_hashes[block] = None
        self.ref_counts[block] = 1
        return block

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the hashes of the request's blocks that are full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(request.request_id, [])
        num_full = request.num_computed_tokens // self.block_size
        released = self.req_released.get(request.request_id, 0)  # published before their release
        hashes = self.block_hashes_of(request)
        for block, block_hash in zip(blocks[released:num_full], hashes[released:num_full]):
            if self.block_hashes[block] is None and block_hash not in self.cached_blocks:
                self.block_hashes[block] = block_hash
                self.cached_blocks[block_hash] = block

    def release_before(self, request: Request, position: int) -> None:
        """Release the request's blocks that lie wholly before `position` (no query of it will see
        them again): each is dereferenced, and once unused goes to the free pool, where a cached one
        keeps its hash for prefix caching. The table keeps its length, `PLACEHOLDER` in their place."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        released = self.req_released.get(request.request_id, 0)
        end = min(max(position, 0) // self.block_size, len(blocks))
        if end <= released:
            return
        for index in range(released, end):
            self._deref(blocks[index])
            blocks[index] = PLACEHOLDER
        self.req_released[request.request_id] = end

    def _deref(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None

    def free(self, request: Request) -> None:
        """Release the request's blocks; the last blocks of a sequence are evicted first."""
        blocks = self.req_blocks.pop(request.request_id, [])
        released = self.req_released.pop(request.request_id, 0)
        for block in reversed(blocks[released:]):
            self._deref(block)
        self.req_hashes.pop(request.request_id, None)
        if self.states is not None:
            self.states.release(request.request_id)
        self.req_restores.pop(request.request_id, None)
        self.req_output_snapshots.pop(request.request_id, None)  # its last one stays, for the next turn

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


def _first_block_seed(request: Request) -> bytes:
    """What a request's first block hash starts from: its LoRA adapter (an adapter's blocks hold its own keys and
    values) and the hash of its prompt embeddings (their placeholder ids say nothing); empty for plain prompts."""
    lora = request.sampling_params.lora
    seed = f"lora:{lora.lora_int_id}" if lora is not None else ""
    if request.embeds_hash is not None:
        seed += f"|embeds:{request.embeds_hash}"
    return seed.encode()
