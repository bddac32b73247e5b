"""BlockManager: allocation, ref counts, and prefix caching with image-aware block hashes."""

from __future__ import annotations

import pytest

from tessera.engine.core.block_manager import PLACEHOLDER, BlockManager
from tessera.engine.core.request import MultiModalItem, Request
from tessera.multimodal.inputs import MultiModalKwargsItem, PlaceholderRange
from tessera.sampling_params import SamplingParams

BS = 4  # block size


def make_request(request_id, tokens, images=()):
    """images: (content hash, offset, length) of each image's placeholder tokens."""
    items = [
        MultiModalItem("image", h, MultiModalKwargsItem(), PlaceholderRange(offset, length))
        for h, offset, length in images
    ]
    return Request(request_id, list(tokens), SamplingParams(), mm_items=items)


def admit(manager, request):
    """Admit like the scheduler: take the cached prefix, allocate the rest, compute it all, publish."""
    cached = manager.find_cached_prefix(request)
    num_new = request.num_tokens - len(cached) * BS
    assert manager.allocate(request, num_new, cached)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    return cached


def state(manager):
    return (list(manager.free_blocks), list(manager.ref_counts), dict(manager.req_blocks), dict(manager.cached_blocks))


@pytest.mark.parametrize("num_tokens", [1, 4, 5, 8, 10])
def test_allocate_gives_ceil_tokens_over_block_size_distinct_blocks(num_tokens):
    manager = BlockManager(10, BS)
    request = make_request("a", range(num_tokens))
    assert manager.allocate(request, num_tokens)
    blocks = manager.blocks_of(request)
    assert len(blocks) == len(set(blocks)) == -(-num_tokens // BS)
    assert manager.num_free_blocks == 10 - len(blocks)
    assert all(manager.ref_counts[b] == 1 for b in blocks)


def test_decode_tokens_take_a_new_block_only_when_the_last_one_is_full():
    manager = BlockManager(10, BS)
    request = make_request("a", range(6))
    admit(manager, request)
    counts = []
    for token in range(100, 106):  # decode: one more token per step
        request.output_token_ids.append(token)
        assert manager.allocate(request, 1)
        request.num_computed_tokens += 1
        counts.append(len(manager.blocks_of(request)))
    assert counts == [-(-n // BS) for n in range(7, 13)]


def test_free_returns_every_block():
    manager = BlockManager(10, BS)
    request = make_request("a", range(10))
    admit(manager, request)
    manager.free(request)
    assert manager.num_free_blocks == 10
    assert manager.ref_counts == [0] * 10
    assert manager.blocks_of(request) == []


def test_a_request_with_the_same_full_blocks_finds_them():
    manager = BlockManager(10, BS)
    first = make_request("a", range(10))  # 2 full blocks + 2 tokens
    admit(manager, first)
    second = make_request("b", list(range(8)) + [50, 51, 52])  # same 2 full blocks, other tail
    assert manager.find_cached_prefix(second) == manager.blocks_of(first)[:2]
    other = make_request("c", [99] + list(range(1, 10)))  # first block differs: nothing matches
    assert manager.find_cached_prefix(other) == []


def test_shared_blocks_are_ref_counted_and_survive_the_first_owner():
    manager = BlockManager(10, BS)
    first, second = make_request("a", range(10)), make_request("b", list(range(8)) + [50, 51, 52])
    admit(manager, first)
    shared = admit(manager, second)
    assert len(shared) == 2 and manager.blocks_of(second)[:2] == shared
    assert [manager.ref_counts[b] for b in shared] == [2, 2]
    assert manager.num_free_blocks == 10 - 3 - 1  # first: 3 blocks; second: 1 of its own
    manager.free(first)
    assert [manager.ref_counts[b] for b in shared] == [1, 1]
    assert not set(shared) & set(manager.free_blocks)
    assert manager.num_free_blocks == 10 - 3


@pytest.mark.parametrize("num_tokens", [4, 8, 9, 12])
def test_at_least_one_token_is_always_left_to_compute(num_tokens):
    manager = BlockManager(10, BS)
    admit(manager, make_request("a", range(12)))
    cached = manager.find_cached_prefix(make_request("b", range(num_tokens)))
    assert len(cached) == (num_tokens - 1) // BS
    assert len(cached) * BS < num_tokens


def test_freed_blocks_stay_cached_and_are_taken_back_from_the_free_list():
    manager = BlockManager(10, BS)
    first = make_request("a", range(9))
    admit(manager, first)
    blocks = list(manager.blocks_of(first))
    manager.free(first)
    again = make_request("b", range(9))
    assert admit(manager, again) == blocks[:2]
    assert manager.num_free_blocks == 10 - 3
    assert all(manager.ref_counts[b] == 1 for b in manager.blocks_of(again))


def test_cached_blocks_are_evicted_only_when_needed_and_a_sequence_tail_goes_before_its_head():
    manager = BlockManager(4, BS)
    first = make_request("a", range(12))  # 3 full blocks: head, middle, tail
    admit(manager, first)
    head, middle, tail = manager.blocks_of(first)
    manager.free(first)

    def cached_prefix():
        return manager.find_cached_prefix(make_request("probe", list(range(13))))

    assert cached_prefix() == [head, middle, tail]
    assert manager.allocate(make_request("b", [90]), 1)  # takes the never-used block
    assert cached_prefix() == [head, middle, tail]
    assert manager.allocate(make_request("c", [91]), 1)  # evicts the tail first
    assert cached_prefix() == [head, middle]
    assert manager.allocate(make_request("d", [92]), 1)  # then the middle
    assert cached_prefix() == [head]


def test_the_least_recently_freed_sequence_is_evicted_first():
    manager = BlockManager(4, BS)
    a, b = make_request("a", range(5)), make_request("b", range(100, 105))
    admit(manager, a)
    admit(manager, b)
    b_head = manager.blocks_of(b)[0]
    manager.free(a)
    manager.free(b)
    assert manager.allocate(make_request("c", [1, 2, 3, 4, 5]), 5)  # needs 2 blocks: a's
    assert manager.find_cached_prefix(make_request("a2", range(5))) == []
    assert manager.find_cached_prefix(make_request("b2", range(100, 105))) == [b_head]


def test_without_prefix_caching_nothing_is_found():
    manager = BlockManager(10, BS, enable_prefix_caching=False)
    admit(manager, make_request("a", range(9)))
    assert manager.find_cached_prefix(make_request("b", range(9))) == []


# ---- image-aware hashes ------------------------------------------------------------------------

TOKENS = list(range(16))


@pytest.mark.parametrize(
    "offset, length, first_changed",
    [(4, 4, 1), (6, 4, 1), (2, 9, 0), (12, 4, 3)],
    ids=["block-1", "blocks-1-2", "blocks-0-2", "last-block"],
)
def test_a_block_hash_changes_from_the_first_block_an_image_overlaps(offset, length, first_changed):
    manager = BlockManager(10, BS)
    hashes_a = manager.block_hashes_of(make_request("a", TOKENS, [("img-a", offset, length)]))
    hashes_b = manager.block_hashes_of(make_request("b", TOKENS, [("img-b", offset, length)]))
    assert len(hashes_a) == len(hashes_b) == len(TOKENS) // BS
    assert hashes_a[:first_changed] == hashes_b[:first_changed]
    # the hash is chained: every block from the first overlapping one on differs
    assert all(x != y for x, y in zip(hashes_a[first_changed:], hashes_b[first_changed:]))


def test_the_same_image_at_another_offset_changes_the_hash():
    manager = BlockManager(10, BS)
    at_4 = manager.block_hashes_of(make_request("a", TOKENS, [("img", 4, 3)]))
    at_5 = manager.block_hashes_of(make_request("b", TOKENS, [("img", 5, 3)]))
    assert at_4[0] == at_5[0] and at_4[1] != at_5[1]


def test_same_tokens_with_another_image_reuse_only_the_blocks_before_it():
    manager = BlockManager(10, BS)
    first = make_request("a", TOKENS + [99], [("img-a", 5, 6)])
    admit(manager, first)
    same = make_request("b", TOKENS + [99], [("img-a", 5, 6)])
    other = make_request("c", TOKENS + [99], [("img-b", 5, 6)])
    assert manager.find_cached_prefix(same) == manager.blocks_of(first)[:4]
    assert manager.find_cached_prefix(other) == manager.blocks_of(first)[:1]


# ---- running out -------------------------------------------------------------------------------


def test_allocate_returns_false_and_changes_nothing_when_blocks_run_out():
    manager = BlockManager(3, BS)
    assert manager.allocate(make_request("a", range(8)), 8)
    before = state(manager)
    assert not manager.allocate(make_request("b", range(100, 108)), 8)
    assert state(manager) == before


def test_a_failed_allocate_leaves_a_reusable_cached_prefix_free():
    manager = BlockManager(3, BS)
    first = make_request("a", range(9))
    admit(manager, first)
    manager.free(first)  # 3 free blocks, 2 of them cached
    longer = make_request("b", range(17))  # its 2 cached blocks + 3 more: too many
    cached = manager.find_cached_prefix(longer)
    assert len(cached) == 2
    before = state(manager)
    assert not manager.allocate(longer, longer.num_tokens - 2 * BS, cached)
    assert state(manager) == before
    assert manager.find_cached_prefix(make_request("c", range(9))) == cached


def test_a_cached_prefix_held_by_another_request_is_not_counted_as_free():
    manager = BlockManager(4, BS)
    first = make_request("a", range(9))  # 3 blocks, 1 free left
    admit(manager, first)
    second = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])  # 2 shared + 2 of its own
    cached = manager.find_cached_prefix(second)
    assert len(cached) == 2
    assert not manager.allocate(second, second.num_tokens - 2 * BS, cached)
    shorter = make_request("c", list(range(8)) + [50])  # 2 shared + 1 of its own
    assert manager.allocate(shorter, 1, manager.find_cached_prefix(shorter))
    assert manager.num_free_blocks == 0


def test_no_blocks_is_an_error():
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, BS)


# ---- releasing blocks that fell out of every window ---------------------------------------------


def test_release_before_frees_the_blocks_wholly_before_the_position_and_keeps_the_table_length():
    manager = BlockManager(10, BS)
    request = make_request("a", range(10))  # blocks for positions 0-3, 4-7, 8-9
    admit(manager, request)
    first, second, third = manager.blocks_of(request)
    manager.release_before(request, 7)  # block 1 holds position 7: only block 0 is wholly before it
    assert manager.blocks_of(request) == [PLACEHOLDER, second, third]
    assert manager.live_blocks_of(request) == [second, third]
    assert manager.num_free_blocks == 10 - 2
    manager.release_before(request, 8)
    assert manager.blocks_of(request) == [PLACEHOLDER, PLACEHOLDER, third]
    assert manager.live_blocks_of(request) == [third]
    assert manager.num_free_blocks == 10 - 1
    assert manager.ref_counts[first] == manager.ref_counts[second] == 0 and manager.ref_counts[third] == 1


@pytest.mark.parametrize("position", [-5, 0, 3])
def test_release_before_the_first_block_ends_releases_nothing(position):
    manager = BlockManager(10, BS)
    request = make_request("a", range(10))
    admit(manager, request)
    before = state(manager)
    manager.release_before(request, position)
    assert state(manager) == before


def test_releasing_again_or_before_an_earlier_position_changes_nothing():
    manager = BlockManager(10, BS)
    request = make_request("a", range(10))
    admit(manager, request)
    manager.release_before(request, 8)
    after = state(manager)
    manager.release_before(request, 8)
    manager.release_before(request, 5)
    assert state(manager) == after
    manager.release_before(request, 100)  # past the table: every block, never more
    assert manager.blocks_of(request) == [PLACEHOLDER] * 3
    assert manager.num_free_blocks == 10 and manager.ref_counts == [0] * 10


def test_free_after_release_frees_each_block_once():
    manager = BlockManager(10, BS)
    request = make_request("a", range(10))
    admit(manager, request)
    manager.release_before(request, 8)
    manager.free(request)
    assert manager.num_free_blocks == 10
    assert sorted(manager.free_blocks) == list(range(10))
    assert manager.ref_counts == [0] * 10
    assert manager.blocks_of(request) == [] and manager.live_blocks_of(request) == []


def test_released_blocks_count_as_free_for_allocation():
    manager = BlockManager(4, BS)
    first = make_request("a", range(16))  # the whole cache
    admit(manager, first)
    second = make_request("b", [50, 51, 52])
    assert not manager.allocate(second, 3)
    manager.release_before(first, 13)  # positions 0-11: three blocks
    assert manager.allocate(second, 3)
    first.output_token_ids.append(99)  # a 17th token needs a 5th table entry
    assert manager.allocate(first, 1)
    assert len(manager.blocks_of(first)) == 5 and len(manager.live_blocks_of(first)) == 2
    assert manager.num_free_blocks == 4 - 2 - 1


def test_a_released_cached_block_is_found_again_by_the_same_prefix():
    manager = BlockManager(10, BS)
    first = make_request("a", range(10))
    admit(manager, first)
    head = manager.blocks_of(first)[:2]
    manager.release_before(first, 8)
    assert all(manager.ref_counts[b] == 0 and b in manager.free_blocks for b in head)
    second = make_request("b", list(range(8)) + [50, 51])
    assert admit(manager, second) == head
    assert all(manager.ref_counts[b] == 1 and b not in manager.free_blocks for b in head)
    assert manager.num_free_blocks == 10 - 2 - 1 - 1  # head, first's tail, second's tail


def test_without_prefix_caching_released_blocks_return_uncached():
    manager = BlockManager(10, BS, enable_prefix_caching=False)
    first = make_request("a", range(10))
    admit(manager, first)
    manager.release_before(first, 8)
    assert manager.num_free_blocks == 9 and manager.cached_blocks == {}
    assert manager.find_cached_prefix(make_request("b", range(10))) == []


def test_a_released_block_another_request_shares_stays_held():
    manager = BlockManager(10, BS)
    first, second = make_request("a", range(10)), make_request("b", range(10))
    admit(manager, first)
    assert admit(manager, second) == manager.blocks_of(first)[:2]
    shared = manager.blocks_of(first)[:2]
    manager.release_before(first, 8)
    assert all(manager.ref_counts[b] == 1 and b not in manager.free_blocks for b in shared)
    assert manager.blocks_of(second)[:2] == shared
    manager.free(second)
    assert all(manager.ref_counts[b] == 0 and b in manager.free_blocks for b in shared)


def test_placeholders_never_get_the_hashes_of_the_blocks_they_replace():
    """A released block taken by another request holds other tokens: publishing the releasing request's
    blocks must not give it their hash (a later identical prompt would read the other tokens)."""
    manager = BlockManager(6, BS)
    first = make_request("a", range(9))
    admit(manager, first)  # blocks 0, 1 (published), 2
    manager.release_before(first, 8)  # 0 and 1 back to the free pool, still cached
    other = make_request("b", range(100, 120))
    assert manager.allocate(other, 20)  # the whole free pool: 0 and 1 evicted
    assert set(manager.blocks_of(other)) >= {0, 1} and manager.block_hashes[0] is None
    for token in range(9, 12):  # first decodes to a third full block (no new block) and publishes it
        first.output_token_ids.append(token)
        assert manager.allocate(first, 1)
        first.num_computed_tokens += 1
        manager.cache_full_blocks(first)
    assert manager.block_hashes[0] is None and manager.block_hashes[1] is None
    assert manager.block_hashes[2] is not None
    assert manager.find_cached_prefix(make_request("c", range(13))) == []  # its head is gone
