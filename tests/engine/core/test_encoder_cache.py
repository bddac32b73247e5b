"""EncoderCache: entries held by requests stay; unreferenced ones are evicted least recently used first."""

from __future__ import annotations

import pytest
import torch

from tessera.engine.core.encoder_cache import EncoderCache


def rows(n, value=0.0):
    return torch.full((n, 3), value)


def test_lookup_of_a_missing_item_is_a_miss_and_holds_nothing():
    cache = EncoderCache(10)
    assert not cache.lookup("img", "r1")
    assert cache.num_referenced == 0
    assert (cache.hits, cache.queries) == (0, 1)


def test_put_then_lookup_returns_the_embeddings_and_adds_a_reference():
    cache = EncoderCache(10)
    cache.put("img", rows(4, 1.5), {"r1"})
    assert cache.lookup("img", "r2")
    assert torch.equal(cache.get("img"), rows(4, 1.5))
    assert cache.refs["img"] == {"r1", "r2"}
    assert (cache.used, cache.num_encoded, cache.hits, cache.queries) == (4, 1, 1, 1)


def test_release_item_drops_one_request_from_one_entry():
    cache = EncoderCache(10)
    cache.put("a", rows(2), {"r1", "r2"})
    cache.put("b", rows(2), {"r1"})
    cache.release_item("a", "r1")
    assert cache.refs == {"a": {"r2"}, "b": {"r1"}}
    cache.release_item("missing", "r1")  # harmless


def test_release_drops_the_request_from_every_entry():
    cache = EncoderCache(10)
    cache.put("a", rows(2), {"r1", "r2"})
    cache.put("b", rows(2), {"r1"})
    assert cache.num_referenced == 2
    cache.release("r1")
    assert cache.refs == {"a": {"r2"}, "b": set()}
    assert cache.num_referenced == 1
    assert cache.used == 4  # released entries stay cached


def test_put_evicts_unreferenced_entries_only():
    cache = EncoderCache(10)
    cache.put("held", rows(4), {"r1"})
    cache.put("free", rows(4), {"r2"})
    cache.release("r2")
    cache.put("new", rows(4), {"r3"})
    assert set(cache.entries) == {"held", "new"}
    assert cache.used == 8


def test_the_least_recently_used_unreferenced_entry_goes_first():
    cache = EncoderCache(9)
    for name in ("a", "b", "c"):
        cache.put(name, rows(3), {"r"})
    cache.release("r")
    assert cache.lookup("a", "r2")  # a is now the most recently used ...
    cache.release("r2")  # ... and unreferenced again
    cache.put("d", rows(3), {"r3"})
    assert set(cache.entries) == {"a", "c", "d"}
    cache.put("e", rows(3), {"r3"})
    assert set(cache.entries) == {"a", "d", "e"}


def test_put_evicts_as_many_entries_as_needed_and_no_more():
    cache = EncoderCache(12)
    for name in ("a", "b", "c"):
        cache.put(name, rows(3), set())
    cache.put("big", rows(8), {"r"})  # 9 + 8 rows: a and b must go, c may stay
    assert set(cache.entries) == {"c", "big"}


def test_put_with_only_referenced_entries_and_no_room_is_an_error():
    cache = EncoderCache(6)
    cache.put("a", rows(4), {"r1"})
    with pytest.raises(RuntimeError, match="overfull"):
        cache.put("b", rows(4), {"r2"})


@pytest.mark.parametrize(
    "num_rows, pending, fits",
    [(6, 0, True), (7, 0, False), (2, 4, True), (3, 4, False), (0, 6, True)],
)
def test_can_fit_counts_referenced_entries_and_pending_rows_but_not_evictable_ones(num_rows, pending, fits):
    cache = EncoderCache(10)
    cache.put("held", rows(4), {"r1"})
    cache.put("evictable", rows(4), set())
    assert cache.can_fit(num_rows, pending) is fits
