"""`EngineCoreClient`: the one interface a front-end (`LLMEngine`) drives an engine core through, wherever the
core runs (vLLM v1's EngineCoreClient):

- in this thread: `EngineCore` itself (the offline `LLM`, and the server's engine thread);
- in a child process: `ReplicaClient` (engine/executor/replica.py), the core fed processed requests over a pipe;
- over N child processes: `DataParallelClient` (engine/executor/data_parallel.py), a router in front of N replicas.

Every call comes from one thread, the front-end's. `step()` returns the next outputs: an in-thread core runs a
step; a remote one waits until outputs arrive, `wake()` is called, or the core dies (then it raises
`EngineDeadError`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from .core_io import EngineCoreInfo, EngineCoreOutput, EngineCoreRequest

logger = logging.getLogger(__name__)


class EngineCoreClient(Protocol):
    info: EngineCoreInfo
    """What the core reported at start-up: limits, EOS ids, cache size."""

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue one processed sequence."""

    def abort(self, request_ids: Iterable[str], *, stopped: bool = False) -> None:
        """End these sequences (`stopped`: a stop string ended them) and free what they hold."""

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[EngineCoreOutput]:
        """The next outputs (an in-thread core steps once; a remote one waits for them)."""

    def wake(self) -> None:
        """Make a waiting `step()` return now (the front-end has calls to run)."""

    def stats(self) -> dict[str, int]:
        """The core's counters (summed over replicas)."""

    def replica_stats(self) -> list[dict[str, int]]:
        """Each replica's counters (one entry for a single core)."""

    def watch(self, on_death: Callable[[BaseException], None]) -> None:
        """Call `on_death(error)` (from any thread) when the core, a replica or a tensor-parallel rank dies."""

    def check_health(self) -> None:
        """Raise if the core can no longer step."""

    def shutdown(self) -> None: ...


def report_death(callbacks: Iterable[Callable[[BaseException], None]], error: BaseException) -> None:
    """Call each `watch` / `on_dead` callback with `error`; one that fails is logged and the others still run."""
    for callback in list(callbacks):
        try:
            callback(error)
        except Exception:
            logger.exception("A callback on the death of the engine failed")
