"""Unit tests for tessera.multimodal.cache: the byte-bounded LRU processor-output cache."""

from __future__ import annotations

import pytest
import torch

from tessera.multimodal.cache import ProcessingCache
from tessera.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItem

FLOAT32_BYTES = 4


def item_of(num_floats: int) -> MultiModalKwargsItem:
    """An item whose only tensor is `num_floats` float32 values: num_floats * 4 bytes."""
    elems = MultiModalFieldConfig.batched("image").build_elems("pixel_values", torch.zeros(1, num_floats))
    return MultiModalKwargsItem.from_elems(elems)


def test_item_of_has_expected_size():
    assert item_of(10).nbytes() == 10 * FLOAT32_BYTES


def test_put_then_get_returns_the_item():
    cache = ProcessingCache(1000)
    item = item_of(10)
    cache.put("a", item)
    assert "a" in cache and len(cache) == 1
    assert cache.get("a") is item


def test_get_of_unknown_key_is_none():
    assert ProcessingCache(1000).get("missing") is None


def test_eviction_removes_least_recently_inserted_when_untouched():
    cache = ProcessingCache(100)  # room for two 40-byte items
    cache.put("a", item_of(10))
    cache.put("b", item_of(10))
    cache.put("c", item_of(10))
    assert "a" not in cache
    assert "b" in cache and "c" in cache


def test_eviction_removes_least_recently_used():
    cache = ProcessingCache(100)
    cache.put("a", item_of(10))
    cache.put("b", item_of(10))
    assert cache.get("a") is not None  # "a" is now more recent than "b"
    cache.put("c", item_of(10))
    assert "b" not in cache
    assert "a" in cache and "c" in cache


def test_eviction_frees_as_many_items_as_needed():
    cache = ProcessingCache(100)
    for key in "abc":
        cache.put(key, item_of(8))  # 32 bytes each: 96 in all
    cache.put("big", item_of(20))  # 80 bytes: leaves 20, less than any 32-byte item
    assert [k for k in ["a", "b", "c", "big"] if k in cache] == ["big"]
    assert cache.used_bytes == 20 * FLOAT32_BYTES


def test_item_larger_than_capacity_is_not_stored_and_evicts_nothing():
    cache = ProcessingCache(100)
    cache.put("a", item_of(10))
    cache.put("huge", item_of(26))  # 104 bytes > 100
    assert "huge" not in cache
    assert "a" in cache
    assert cache.used_bytes == 10 * FLOAT32_BYTES


def test_item_of_exactly_capacity_is_stored():
    cache = ProcessingCache(100)
    cache.put("full", item_of(25))
    assert "full" in cache
    assert cache.used_bytes == 100


def test_used_bytes_is_sum_of_stored_item_sizes():
    cache = ProcessingCache(1000)
    sizes = {"a": 10, "b": 3, "c": 50}
    for key, n in sizes.items():
        cache.put(key, item_of(n))
    assert cache.used_bytes == sum(sizes.values()) * FLOAT32_BYTES


def test_used_bytes_after_eviction_counts_only_survivors():
    cache = ProcessingCache(100)
    cache.put("a", item_of(10))
    cache.put("b", item_of(5))
    cache.put("c", item_of(15))  # 40 + 20 + 60 > 100: "a" goes
    assert "a" not in cache
    assert cache.used_bytes == (5 + 15) * FLOAT32_BYTES


def test_replacing_a_key_updates_used_bytes():
    cache = ProcessingCache(1000)
    cache.put("a", item_of(10))
    cache.put("a", item_of(3))
    assert len(cache) == 1
    assert cache.used_bytes == 3 * FLOAT32_BYTES


def test_stats_count_hits_and_queries():
    cache = ProcessingCache(1000)
    cache.put("a", item_of(1))
    for key in ["a", "b", "a", "c"]:
        cache.get(key)
    assert (cache.stats.hits, cache.stats.queries) == (2, 4)
    assert cache.stats.hit_rate == 2 / 4


def test_contains_does_not_count_as_query():
    cache = ProcessingCache(1000)
    cache.put("a", item_of(1))
    assert "a" in cache
    assert cache.stats.queries == 0


def test_hit_rate_without_queries_is_zero():
    assert ProcessingCache(10).stats.hit_rate == 0.0


def test_clear_empties_the_cache():
    cache = ProcessingCache(1000)
    cache.put("a", item_of(10))
    cache.clear()
    assert len(cache) == 0 and cache.used_bytes == 0 and "a" not in cache


@pytest.mark.parametrize("capacity", [0, -1])
def test_constructor_rejects_non_positive_capacity(capacity):
    with pytest.raises(ValueError, match="capacity_bytes must be positive"):
        ProcessingCache(capacity)


def test_from_gb_zero_disables_the_cache():
    assert ProcessingCache.from_gb(0) is None


def test_from_gb_negative_raises():
    with pytest.raises(ValueError, match="must be >= 0"):
        ProcessingCache.from_gb(-1)


@pytest.mark.parametrize("gb, expected_bytes", [(0.5, 512 * 1024 * 1024), (2, 2 * 1024 * 1024 * 1024)])
def test_from_gb_capacity_in_gib(gb, expected_bytes):
    cache = ProcessingCache.from_gb(gb)
    assert cache is not None
    assert cache.capacity_bytes == expected_bytes
