"""Processor-output cache: per-item HF processor outputs, LRU, bounded in bytes.

HF image processors are slow (resizing, normalising in Python); chat clients resend the same
images every turn. Items are keyed by `MultiModalHasher` hashes of the model, the item and the
processor kwargs, so a hit is exactly what the HF processor would have produced.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

from cachetools import LRUCache

from .inputs import MultiModalKwargsItem

GiB = 1 << 30


@dataclass
class CacheStats:
    hits: int = 0
    queries: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class ProcessingCache:
    """Thread-safe: the server processes prompts on a worker pool."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}; disable the cache instead.")
        self.capacity_bytes = capacity_bytes
        self._cache: LRUCache[str, MultiModalKwargsItem] = LRUCache(
            maxsize=capacity_bytes, getsizeof=lambda item: max(item.nbytes(), 1)
        )
        self.stats = CacheStats()
        self._lock = threading.Lock()

    @classmethod
    def from_gb(cls, gb: float) -> Optional["ProcessingCache"]:
        """A cache of `gb` GiB, or None when `gb` is 0 (caching disabled)."""
        if not gb >= 0:  # also rejects NaN
            raise ValueError(f"mm_processor_cache_gb must be >= 0, got {gb}")
        return cls(int(gb * GiB)) if gb > 0 else None

    def get(self, key: str) -> Optional[MultiModalKwargsItem]:
        with self._lock:
            self.stats.queries += 1
            item = self._cache.get(key)
            if item is not None:
                self.stats.hits += 1
            return item

    def put(self, key: str, item: MultiModalKwargsItem) -> None:
        if item.nbytes() > self.capacity_bytes:
            return  # larger than the whole cache: keep the others rather than evict everything
        with self._lock:
            self._cache[key] = item

    def __contains__(self, key: str) -> bool:
        return key in self._cache

    def __len__(self) -> int:
        return len(self._cache)

    @property
    def used_bytes(self) -> int:
        return int(self._cache.currsize)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
