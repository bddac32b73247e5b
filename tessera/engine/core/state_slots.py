"""Rows of a hybrid model's state (layers/state_cache.py): one per running sequence, and snapshots for
prefix caching.

A recurrent layer's state after a prefix is all a later request with that prefix needs from it, but unlike
KV blocks it is not kept for every token. So the stateful layers also write a sequence's state at chosen
block boundaries into snapshot rows, found later by the hash of the block ending there (whose chain covers
every token and image before it): the last boundary at or before each image's end (another question about
the image), the last before the prompt's last token, and the end of each block of the output (only the
latest kept per request: the next turn of a chat starts with this one's prompt and answer)
(`BlockManager.snapshot_boundaries`). A request whose cached blocks
reach a snapshotted block restores the snapshot into its own row and computes from there; its cached blocks
beyond the last snapshot are not used (the state after them is unknown), never a wrong state. Snapshots are
evicted least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Optional


class StateSlots:
    def __init__(self, num_slots: int, num_snapshots: int = 0) -> None:
        """Rows 0..num_slots-1 hold running sequences' states; the next num_snapshots rows hold snapshots."""
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        self.reset()

    def reset(self) -> None:
        self.free_slots = list(range(self.num_slots))
        self.slots: dict[str, int] = {}  # request id -> its row
        self.free_snapshot_rows = list(range(self.num_slots, self.num_slots + self.num_snapshots))
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> row, least recently used first

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free_slots)

    # ---- running sequences ----------------------------------------------------------------------

    def take(self, request_id: str) -> bool:
        """Give the request a row unless it has one; False when none is free."""
        if request_id in self.slots:
            return True
        if not self.free_slots:
            return False
        self.slots[request_id] = self.free_slots.pop()
        return True

    def slot_of(self, request_id: str) -> int:
        return self.slots[request_id]

    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    # ---- snapshots ------------------------------------------------------------------------------

    def usable_prefix(self, hashes: Sequence[bytes], num_cached: int) -> tuple[int, Optional[int]]:
        """Of `num_cached` cached leading blocks (by their hashes), how many a request can use: those up to
        the last one with a snapshot, and that snapshot's row (None, 0 blocks: none)."""
        for count in range(num_cached, 0, -1):
            row = self.snapshots.get(hashes[count - 1])
            if row is not None:
                self.snapshots.move_to_end(hashes[count - 1])
                return count, row
        return 0, None

    def has_snapshot(self, block_hash: bytes) -> bool:
        return block_hash in self.snapshots

    def reserve_snapshot(self) -> Optional[int]:
        """A row for a new snapshot: a free one, else the least recently used snapshot's; None without rows."""
        if self.free_snapshot_rows:
            return self.free_snapshot_rows.pop()
        if self.snapshots:
            return self.snapshots.popitem(last=False)[1]
        return None

    def drop(self, block_hash: bytes) -> None:
        """Forget the snapshot of `block_hash` (superseded), its row free again."""
        row = self.snapshots.pop(block_hash, None)
        if row is not None:
            self.free_snapshot_rows.append(row)

    def publish(self, block_hash: bytes, row: int) -> None:
        """The state after the block `block_hash` is in `row` (once the step that computed it has run)."""
        previous = self.snapshots.pop(block_hash, None)
        if previous is not None and previous != row:
            self.free_snapshot_rows.append(previous)
        self.snapshots[block_hash] = row


def plan_state_rows(budget: int, row_bytes: int, max_num_seqs: int, prefix_caching: bool) -> tuple[int, int]:
    """(rows for running sequences, snapshot rows) of a hybrid model's state in `budget` bytes (the KV cache
    memory): at most half of it, a third of that for snapshots when prefix caching is on; each at most
    max_num_seqs. ValueError when not even one sequence's state fits."""
    share = budget // 2
    running_share = share * 2 // 3 if prefix_caching else share
    slots = min(max_num_seqs, running_share // row_bytes)
    if slots < 1:
        raise ValueError(
            f"kv_cache_memory {budget} B is too small for the model's recurrent state ({row_bytes} B a sequence, "
            f"kept in at most half of it); give it at least {2 * row_bytes + (row_bytes if prefix_caching else 0)} B"
        )
    snapshots = min(max_num_seqs, (share - slots * row_bytes) // row_bytes) if prefix_caching else 0
    return slots, snapshots
