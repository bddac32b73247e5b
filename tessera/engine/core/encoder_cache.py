"""Vision-encoder outputs, keyed by item content hash, bounded in embedding rows.

An image is encoded once even when its placeholders span several prefill chunks, and a repeated
image skips the encoder. Entries referenced by running requests stay; unreferenced ones remain
reusable until space is needed, least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # embedding rows
        self.reset()

    def reset(self) -> None:
        """Empty, counters at zero."""
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.refs: dict[str, set[str]] = {}  # item hash -> ids of requests using it
        self.num_encoded = 0  # items run through the encoder, for stats and tests
        self.hits = self.queries = 0

    @property
    def used(self) -> int:
        return sum(e.shape[0] for e in self.entries.values())

    @property
    def num_referenced(self) -> int:
        return sum(1 for users in self.refs.values() if users)

    def lookup(self, item_hash: str, request_id: str) -> bool:
        """Whether the item is cached; if so the request now holds it."""
        self.queries += 1
        if item_hash not in self.entries:
            return False
        self.hits += 1
        self.entries.move_to_end(item_hash)
        self.refs.setdefault(item_hash, set()).add(request_id)
        return True

    def can_fit(self, num_rows: int, pending: int = 0) -> bool:
        """Whether `num_rows` more (beyond `pending` already promised this step) fit after evicting
        every unreferenced entry."""
        referenced = sum(e.shape[0] for h, e in self.entries.items() if self.refs.get(h))
        return referenced + pending + num_rows <= self.capacity

    def put(self, item_hash: str, embeddings: torch.Tensor, request_ids: set[str]) -> None:
        self.num_encoded += 1
        while self.used + embeddings.shape[0] > self.capacity:
            victim = next((h for h in self.entries if not self.refs.get(h)), None)
            if victim is None:
                raise RuntimeError("Encoder cache overfull: the scheduler admitted more than fits")
            del self.entries[victim]
            self.refs.pop(victim, None)
        self.entries[item_hash] = embeddings
        self.refs.setdefault(item_hash, set()).update(request_ids)

    def get(self, item_hash: str) -> torch.Tensor:
        return self.entries[item_hash]

    def release_item(self, item_hash: str, request_id: str) -> None:
        """The request is done with this item (its placeholders are computed)."""
        self.refs.get(item_hash, set()).discard(request_id)

    def release(self, request_id: str) -> None:
        """The request no longer needs any entry (finished or preempted)."""
        for users in self.refs.values():
            users.discard(request_id)
