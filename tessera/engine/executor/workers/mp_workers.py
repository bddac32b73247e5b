"""Worker ranks as local processes (multiprocessing, spawned: a fresh interpreter each, so CUDA and
torch's thread pools start clean). A worker that fails sends its traceback over a pipe before exiting,
so rank 0's error says what went wrong there, not only that the rank is gone."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import signal
import sys
import threading
import time
import traceback
from typing import Any, Optional

from ....config import ModelConfig
from .base import WorkerGroup
from .worker import run_worker


def _process_main(conn: Any, *args: Any) -> None:
    try:
        run_worker(*args)
    except BaseException:
        try:
            conn.send(traceback.format_exc(limit=-8))
        finally:
            sys.exit(1)


class MultiprocWorkers(WorkerGroup):
    backend_name = "mp"

    def _spawn(self, host: str, port: int, model_config: ModelConfig) -> None:
        context = multiprocessing.get_context("spawn")
        self.processes, self.errors, self.messages, self.lock = [], [], {}, threading.Lock()
        for rank in range(1, self.world_size):
            receiver, sender = context.Pipe(duplex=False)
            args = (sender, rank, self.world_size, host, port, self.backend, model_config, self.num_threads)
            process = context.Process(target=_process_main, args=args, name=f"tessera-tp-rank{rank}", daemon=True)
            process.start()
            sender.close()
            self.processes.append(process)
            self.errors.append(receiver)

    def _dead_workers(self) -> list[str]:
        with self.lock:  # the monitor thread asks too; one reader per pipe
            return self._read_dead_workers()

    def _read_dead_workers(self) -> list[str]:
        dead = []
        for rank, (process, errors) in enumerate(zip(self.processes, self.errors), start=1):
            if process.exitcode is None:
                continue
            how = f"exited with code {process.exitcode}"
            if process.exitcode < 0:
                how = f"was killed by {signal.Signals(-process.exitcode).name}"
            try:
                if rank not in self.messages and errors.poll():
                    self.messages[rank] = f": {errors.recv().strip()}"
            except (EOFError, OSError):
                pass
            dead.append(f"rank {rank} (pid {process.pid}) {how}{self.messages.get(rank, '')}")
        return dead

    def _wait_for_death(self, timeout: Optional[float]) -> list[str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait([p.sentinel for p in self.processes], left)
            dead = self._dead_workers()
            if dead or not ready or (deadline is not None and time.monotonic() >= deadline):
                return dead
            time.sleep(0.01)  # a dying process's sentinel closes a moment before its exit status can be read

    def _stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
