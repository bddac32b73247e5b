"""StateSlots: rows of a hybrid model's state for running sequences and prefix snapshots, and how the KV
budget is shared with them."""

from __future__ import annotations

import pytest

from tessera.engine.core.state_slots import StateSlots, plan_state_rows


def test_running_rows_are_taken_once_and_returned():
    states = StateSlots(2, 1)
    assert states.take("a") and states.take("a") and states.take("b") and not states.take("c")
    assert states.num_used == 2 and {states.slot_of("a"), states.slot_of("b")} == {0, 1}
    states.release("a")
    assert states.take("c") and states.num_used == 2


def test_the_usable_prefix_ends_at_the_last_snapshot_and_snapshots_are_evicted_lru():
    states = StateSlots(1, 2)
    hashes = [b"h0", b"h1", b"h2", b"h3"]
    assert states.usable_prefix(hashes, 4) == (0, None)
    first = states.reserve_snapshot()
    states.publish(b"h1", first)
    assert first >= 1  # snapshot rows come after the running ones
    assert states.usable_prefix(hashes, 4) == (2, first) and states.usable_prefix(hashes, 1) == (0, None)
    second = states.reserve_snapshot()
    states.publish(b"h3", second)
    assert states.usable_prefix(hashes, 4) == (4, second)
    assert states.usable_prefix(hashes, 3) == (2, first)  # h1 is now the most recently used
    third = states.reserve_snapshot()  # no free row: h3's, the least recently used, is taken
    assert third == second and not states.has_snapshot(b"h3") and states.has_snapshot(b"h1")


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_states_take_at_most_half_the_budget(prefix_caching):
    row = 1000
    slots, snapshots = plan_state_rows(60 * row, row, 64, prefix_caching)
    assert (slots, snapshots) == ((20, 10) if prefix_caching else (30, 0))
    assert plan_state_rows(60 * row, row, 4, prefix_caching) == (4, 4 if prefix_caching else 0)
    with pytest.raises(ValueError, match="too small"):
        plan_state_rows(row, row, 4, prefix_caching)


def test_a_dropped_snapshot_frees_its_row():
    states = StateSlots(1, 1)
    row = states.reserve_snapshot()
    states.publish(b"h", row)
    assert states.reserve_snapshot() == row  # evicted: it was the only row
    states.publish(b"h2", row)
    states.drop(b"h2")
    assert not states.has_snapshot(b"h2") and states.reserve_snapshot() == row
