"""Rank 0's side of tensor parallelism: start the worker ranks, join their process group, send them each
step, and fail loudly — never hang — when one dies.

A dead worker's closed connection fails rank 0's next (or current) collective at once, and a monitor
thread notices the death even while the engine is idle, so a server turns unhealthy within about a
second. Any failure once the workers are in a step is fatal (`WorkerDiedError`): the ranks' collectives
no longer pair up, so no further step could be trusted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from ....config import ModelConfig, ParallelConfig
from ....distributed import TensorParallelGroup, create_store, init_tensor_parallel_group
from ....errors import WorkerDiedError
from ...core.client import report_death
from .worker import joined_key

logger = logging.getLogger(__name__)

START_TIMEOUT_S = float(os.environ.get("TESSERA_WORKER_START_TIMEOUT", "300"))
MONITOR_JOIN_S = 5.0  # how long shutdown waits for the death monitor to see the stopped workers


class WorkerGroup:
    """Ranks 1..N-1 of a tensor-parallel group whose rank 0 is this process. Subclasses start and watch
    the workers (`_spawn`, `_dead_workers`, `_wait_for_death`, `_stop`)."""

    backend_name = "?"

    def __init__(self, model_config: ModelConfig, parallel_config: ParallelConfig) -> None:
        self.world_size = parallel_config.tensor_parallel_size
        self.backend = "nccl" if torch.device(model_config.device).type == "cuda" else "gloo"
        self.on_death: list[Callable[[WorkerDiedError], None]] = []
        self._stopping = False
        self._death: Optional[WorkerDiedError] = None
        # on CPU the ranks share the cores: each takes its part instead of all of them each
        self.num_threads = max(1, (os.cpu_count() or 1) // self.world_size) if self.backend == "gloo" else None
        host = self._driver_host()
        store = create_store(host, 0, self.world_size, is_master=True)
        self._spawn(host, store.port, model_config)
        self._wait_joined(store)
        self._threads_before = torch.get_num_threads()
        if self.num_threads:
            logger.info("Tensor parallelism on CPU: %d thread(s) per rank", self.num_threads)
            torch.set_num_threads(self.num_threads)
        self.group: TensorParallelGroup = init_tensor_parallel_group(store, 0, self.world_size, backend=self.backend)
        self._store = store
        self._monitor_thread = threading.Thread(target=self._monitor, name="tessera-worker-monitor", daemon=True)
        self._monitor_thread.start()
        logger.info("Joined a tensor-parallel group of %d ranks (%s workers, %s)",
                    self.world_size, self.backend_name, self.backend)  # fmt: skip

    # ---- rank 0's calls ------------------------------------------------------------------------------

    def start_model(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        """Tell the workers the KV cache's shape (they allocate it, then wait for steps)."""
        self._in_lockstep(lambda: self.group.broadcast_object(
            {"num_blocks": num_blocks, "block_size": block_size, "dtype": dtype}
        ))  # fmt: skip

    def run_model(self, run_local: Callable[[], Any], inputs: Any) -> Any:
        """Send the step's inputs to the workers, then run rank 0's part (`run_local`) with them."""

        def step() -> Any:
            self.group.broadcast_object(inputs)
            return run_local()

        return self._in_lockstep(step)

    def check_health(self) -> None:
        """Raise `WorkerDiedError` if a worker has died."""
        dead = self._dead_workers()
        if dead:
            raise self._death_error(dead)

    def shutdown(self) -> None:
        """Stop the workers (they hold no state worth a goodbye)."""
        if self._stopping:
            return
        self._stopping = True
        self._stop()
        # The monitor wakes once the workers are gone; wait for it here, so that it never drops the last reference
        # to this executor (and its process group) while the interpreter exits: the group's C++ destructor would
        # then abort the process.
        monitor = getattr(self, "_monitor_thread", None)
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout=MONITOR_JOIN_S)
        if self.num_threads and hasattr(self, "_threads_before"):  # rank 0's share back to the whole process
            torch.set_num_threads(self._threads_before)

    # ---- failures ------------------------------------------------------------------------------------

    def _in_lockstep(self, fn: Callable[[], Any]) -> Any:
        if self._death is not None:
            raise self._death
        try:
            return fn()
        except Exception as e:
            dead = self._wait_for_death(2.0)  # a collective fails as soon as the socket closes; the exit follows
            error = self._death_error(dead) if dead else WorkerDiedError(
                f"A tensor-parallel step failed on rank 0 ({type(e).__name__}: {e}); the ranks are out of step, "
                "so the engine cannot run another one. Restart it."
            )  # fmt: skip
            self._death = error
            raise error from e

    def _death_error(self, dead: list[str]) -> WorkerDiedError:
        return WorkerDiedError(
            f"Tensor-parallel worker {'; '.join(dead)}. The engine cannot run another step; restart it."
        )

    def _monitor(self) -> None:
        while not self._stopping:
            dead = self._wait_for_death(None)
            if self._stopping or not dead:
                continue
            self._death = self._death or self._death_error(dead)
            logger.error("%s", self._death)
            report_death(self.on_death, self._death)
            return

    def _wait_joined(self, store: Any) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        keys = [joined_key(rank) for rank in range(1, self.world_size)]
        while not store.check(keys):
            dead = self._dead_workers()
            if dead:
                self.shutdown()
                raise self._death_error(dead)
            if time.monotonic() > deadline:
                self.shutdown()
                raise WorkerDiedError(
                    f"The tensor-parallel workers did not start within {START_TIMEOUT_S:.0f} s "
                    f"({self.backend_name}; with Ray, check that the cluster has a free CPU or GPU per worker)."
                )
            time.sleep(0.02)

    # ---- what a backend provides ---------------------------------------------------------------------

    def _driver_host(self) -> str:
        return "127.0.0.1"

    def _spawn(self, host: str, port: int, model_config: ModelConfig) -> None:
        raise NotImplementedError

    def _dead_workers(self) -> list[str]:
        """One line per dead worker ("rank 1 (pid 123) exited with ...: <its error>"), without waiting."""
        raise NotImplementedError

    def _wait_for_death(self, timeout: Optional[float]) -> list[str]:
        """Wait up to `timeout` seconds (None: until one dies or shutdown) for a worker to die; `_dead_workers()`."""
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError
