"""Data parallelism: N engine cores, each in a process of its own (`ReplicaClient`), behind one front-end.

The front-end (`LLMEngine`: the one input preprocessor and output processor) processes every prompt in its
own process, so each image is decoded, processed and hashed once, there; `DataParallelClient` is the
`EngineCoreClient` it drives, and sends each processed sequence to one replica.

Routing (`Router`): a sequence whose prompt has items goes by its first item's hash (`routing_key`: the
hash the processor gave it, which is the item's id when the prompt named it in "multi_modal_uuids") to the
replica that got that key before, whose prefix cache and encoder cache hold the item; a sequence without
items, or with a key not seen yet, goes to the least-loaded replica (fewest sequences in flight, ties to the
lowest index), and a new key is remembered (a bounded LRU of `max_routing_keys` keys).

A dead replica is not routed around: `step()` raises the `EngineDeadError` that names it as soon as one
dies, and the `watch` callbacks run (the server exits, as it does when its one engine dies).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional

from ..core.client import report_death
from ..core.core_io import EngineCoreInfo, EngineCoreOutput, EngineCoreRequest
from .replica import ReplicaClient, next_outputs


def routing_key(request: EngineCoreRequest) -> Optional[str]:
    """The key a sequence is routed by: its first item's hash, or None for a prompt without items."""
    return f"hash:{request.mm_items[0].hash}" if request.mm_items else None


class Router:
    """Which replica serves a request: the one that got its key before, else the least loaded."""

    def __init__(self, size: int, max_keys: int = 4096) -> None:
        if size < 1:
            raise ValueError(f"A router needs at least one replica, got {size}")
        self.size, self.max_keys = size, max_keys
        self.keys: OrderedDict[str, int] = OrderedDict()

    def route(self, key: Optional[str], loads: Sequence[int], *, remember: bool = True) -> int:
        """The replica for a request with routing key `key` (None: no media), given each replica's
        requests in flight; a new key is remembered for the replica chosen unless `remember` is False."""
        if key is not None:
            index = self.keys.get(key)
            if index is not None:
                self.keys.move_to_end(key)
                return index
        index = min(range(self.size), key=lambda i: (loads[i], i))
        if key is not None and remember:
            self.keys[key] = index
            while len(self.keys) > self.max_keys:
                self.keys.popitem(last=False)
        return index


class DataParallelClient:
    """N replicas of one engine core (the same model and options), each in a process of its own."""

    def __init__(
        self,
        model: str,
        engine_options: Optional[Mapping[str, Any]] = None,
        size: int = 2,
        *,
        start_timeout: Optional[float] = 600.0,
        max_routing_keys: int = 4096,
    ) -> None:
        if size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {size}")
        threads = max(1, (os.cpu_count() or 1) // size)
        options = dict(engine_options or {})
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()  # every replica's outputs, in arrival order
        self.replicas: list[ReplicaClient] = []
        try:
            for index in range(size):  # all start at once, then each is waited for
                self.replicas.append(ReplicaClient(index, model, options, num_threads=threads, outputs=self.outputs))
            for replica in self.replicas:
                replica.wait_ready(start_timeout)
        except BaseException:
            for replica in self.replicas:
                replica.shutdown(timeout=2.0)
            raise
        self.info: EngineCoreInfo = self.replicas[0].info  # type: ignore[assignment]
        self.router = Router(size, max_routing_keys)
        self.owner: dict[str, int] = {}  # sequence id -> the replica running it
        self.dead: Optional[BaseException] = None
        self.on_dead: list[Callable[[BaseException], None]] = []
        self._dead_lock = threading.Lock()
        for replica in self.replicas:
            replica.on_dead.append(self._replica_died)

    @property
    def size(self) -> int:
        return len(self.replicas)

    # ---- EngineCoreClient ----------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self.check_health()
        index = self.router.route(routing_key(request), self.loads())
        self.owner[request.request_id] = index
        self.replicas[index].add_request(request)

    def abort(self, request_ids: Iterable[str], *, stopped: bool = False) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self.owner.pop(request_id, None)
            if index is not None:
                by_replica.setdefault(index, []).append(request_id)
        for index, ids in by_replica.items():
            self.replicas[index].abort(ids, stopped=stopped)

    def has_unfinished_requests(self) -> bool:
        return bool(self.owner)

    def step(self) -> list[EngineCoreOutput]:
        outputs = next_outputs(self.outputs, self.check_health)
        for output in outputs:
            if output.finished:
                self.owner.pop(output.request_id, None)
        return outputs

    def wake(self) -> None:
        self.outputs.put(None)

    def loads(self) -> list[int]:
        return [replica.num_in_flight for replica in self.replicas]

    def replica_stats(self) -> list[dict[str, int]]:
        """Each replica's latest stats snapshot (pushed by the replica), with its sequences in flight."""
        return [{**replica.last_stats, "in_flight": replica.num_in_flight} for replica in self.replicas]

    def refresh_stats(self) -> list[dict[str, int]]:
        """Fresh snapshots from every replica (the pushed ones may be up to a moment old)."""
        for replica in self.replicas:
            replica.stats_now()
        return self.replica_stats()

    def stats(self) -> dict[str, int]:
        """The replicas' latest stats, summed."""
        total: dict[str, int] = {}
        for snapshot in self.replica_stats():
            for name, value in snapshot.items():
                total[name] = total.get(name, 0) + value
        return total

    def watch(self, on_death: Callable[[BaseException], None]) -> None:
        self.on_dead.append(on_death)

    def check_health(self) -> None:
        if self.dead is not None:
            raise self.dead
        for replica in self.replicas:
            replica.check_health()

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica._closing = True  # stopping on purpose is no death
        for replica in self.replicas:
            replica.shutdown()

    def _replica_died(self, error: BaseException) -> None:
        with self._dead_lock:
            if self.dead is not None:
                return
            self.dead = error
        report_death(self.on_dead, error)
