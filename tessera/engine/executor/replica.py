"""An engine core in a local process of its own, and the client the front-end's process drives it with.

The child (`engine/executor/replica_process.py`) builds an `EngineCore` from the engine options and steps it while
it has work. Requests reach it processed (`EngineCoreRequest`: token ids, items with their hashes and
tensors), so the child never renders a chat, loads an image or runs the HF processor, and each item is
hashed once, by the front-end. The child sends back each step's `EngineCoreOutput`s, the rejection of a
request it cannot queue, and a stats snapshot (`EngineCore.stats`) at most every `STATS_INTERVAL` seconds
while busy, and at once when it goes idle. Messages are tuples over a `multiprocessing` Pipe, as msgpack
without pickle (`serial_utils`: a message can build Tessera's data classes and tensors, nothing else).

`ReplicaClient` (the parent's side) sends requests and aborts, and puts what the child sends into an
outputs queue that the front-end's `step()` reads (one queue may serve several replicas: the data-parallel
client). A monitor thread watches the process's sentinel and the reader thread the pipe's end of file: a
replica that dies (killed, crashed) is seen within a second or so; `dead` then names it and its exit
code, the `watch` callbacks run and the queue is woken.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from multiprocessing.connection import wait as wait_for
from typing import Any, Optional

from ...errors import EngineDeadError
from ..core.client import report_death
from ..core.core_io import EngineCoreInfo, EngineCoreOutput, EngineCoreRequest
from .replica_process import replica_main
from .serial_utils import decode, encode

logger = logging.getLogger(__name__)

_LIVE_CLIENTS: "weakref.WeakSet[ReplicaClient]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_clients() -> None:  # before multiprocessing joins its children at exit
    for client in list(_LIVE_CLIENTS):
        client.shutdown(timeout=2.0)


class ReplicaClient:
    """One core process (started at once; `wait_ready()` waits for its core) and its sequences in flight."""

    def __init__(
        self,
        index: int,
        model: str,
        engine_options: Optional[Mapping[str, Any]] = None,
        *,
        num_threads: Optional[int] = None,
        outputs: Optional[queue.SimpleQueue] = None,
    ) -> None:
        """`outputs`: where lists of `EngineCoreOutput` arrive (None: a wake-up); a queue of its own if not given."""
        self.index = index
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        threads = num_threads if num_threads is not None else max(1, os.cpu_count() or 1)
        # not daemonic: a replica may start processes of its own (e.g. tensor-parallel workers); it exits
        # when its pipe closes, and shutdown() (also run at exit) stops it
        self.child_process = context.Process(
            target=replica_main, args=(child_conn, index, model, dict(engine_options or {}), threads),
            name=f"tessera-replica-{index}",
        )  # fmt: skip
        self.child_process.start()
        child_conn.close()
        self.pid = self.child_process.pid
        self.outputs: queue.SimpleQueue = outputs if outputs is not None else queue.SimpleQueue()
        self.info: Optional[EngineCoreInfo] = None
        self.dead: Optional[EngineDeadError] = None
        self.on_dead: list[Callable[[BaseException], None]] = []
        self.last_stats: dict[str, int] = {}
        self.in_flight: set[str] = set()  # sequence ids sent and not yet finished or aborted (the load)
        # ids whose final output the front-end has not taken yet: the reader thread empties `in_flight` a moment
        # before it queues the outputs, so has_unfinished_requests() must follow what step() handed out
        self.unfinished: set[str] = set()  # (kept only when this client's step() is the one reading `outputs`)
        self._steps_itself = outputs is None
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._closing = False  # stopping on purpose: the process's end is no death
        self._shut = False
        _LIVE_CLIENTS.add(self)

    def wait_ready(self, timeout: Optional[float] = None) -> EngineCoreInfo:
        """Wait until the replica's core is built; its start-up info. A replica that fails to start raises
        RuntimeError with the child's error (ValueError for bad input, e.g. no such model folder)."""
        ready = wait_for([self._conn, self.child_process.sentinel], timeout)
        message: Any = None
        if self._conn in ready:
            try:
                message = decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                message = None
        if message is None or message[0] != "ready":
            self.shutdown(timeout=2.0)
            if message is not None and message[0] == "failed":
                _, text, trace, bad_input = message
                if bad_input:  # e.g. no such model folder: said in one line, as the in-process engine says it
                    raise ValueError(f"Engine replica {self.index} failed to start: {text}")
                raise RuntimeError(f"Engine replica {self.index} failed to start: {text}\n{trace}")
            if not ready:
                raise RuntimeError(f"Engine replica {self.index} did not start within {timeout} s")
            raise RuntimeError(f"Engine replica {self.index} exited while starting ({self._exit_description()})")
        _, self.info, self.last_stats = message
        for target, name in ((self._read, "reader"), (self._watch, "monitor")):
            threading.Thread(target=target, name=f"tessera-replica-{self.index}-{name}", daemon=True).start()
        return self.info

    # ---- what the front-end uses ---------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self.dead is None and not self._closing and self.child_process.exitcode is None

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.in_flight.add(request.request_id)
        if self._steps_itself:
            self.unfinished.add(request.request_id)
        self._send(("add", request))

    def abort(self, request_ids: Iterable[str], *, stopped: bool = False) -> None:
        request_ids = list(request_ids)
        self.unfinished.difference_update(request_ids)
        ids = [i for i in request_ids if i in self.in_flight]
        if not ids:
            return
        self.in_flight.difference_update(ids)
        if self.is_alive:
            try:
                self._send(("abort", ids, stopped))
            except EngineDeadError:
                pass

    def has_unfinished_requests(self) -> bool:
        return bool(self.unfinished)

    def step(self) -> list[EngineCoreOutput]:
        """The outputs that arrived, waiting for some (or a `wake()`); raises `EngineDeadError` once it died."""
        outputs = next_outputs(self.outputs, self._check_alive)
        self.unfinished.difference_update(o.request_id for o in outputs if o.finished)
        return outputs

    def wake(self) -> None:
        self.outputs.put(None)

    def stats(self) -> dict[str, int]:
        return dict(self.last_stats)

    def replica_stats(self) -> list[dict[str, int]]:
        return [{**self.last_stats, "in_flight": self.num_in_flight}]

    def watch(self, on_death: Callable[[BaseException], None]) -> None:
        self.on_dead.append(on_death)

    def check_health(self) -> None:
        self._check_alive()

    def stats_now(self, timeout: float = 30.0) -> dict[str, int]:
        """A fresh stats snapshot (also kept as `last_stats`), waiting on this thread."""
        self._check_alive()
        call_id = next(self._ids)
        future: Future = Future()
        self._calls[call_id] = future
        self._send(("stats", call_id))
        self.last_stats = future.result(timeout)
        return self.last_stats

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._shut:
            return
        self._shut = self._closing = True
        _LIVE_CLIENTS.discard(self)
        try:
            self._send(("shutdown",))
        except Exception:
            pass
        self.child_process.join(timeout)
        if self.child_process.exitcode is None:
            self.child_process.terminate()
            self.child_process.join(2.0)
        if self.child_process.exitcode is None:
            self.child_process.kill()
            self.child_process.join(2.0)
        self._conn.close()
        self._fail_calls(EngineDeadError(f"Engine replica {self.index} was shut down."))

    # ---- internals -----------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead
        if not self.is_alive:
            raise EngineDeadError(f"Engine replica {self.index} has stopped.")

    def _send(self, message: tuple) -> None:
        data = encode(message)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError) as e:  # the pipe is gone: the replica died
            if not self._closing:
                threading.Thread(target=self._died, daemon=True).start()
            raise EngineDeadError(f"Engine replica {self.index} is unreachable: {e!r}") from None

    def _read(self) -> None:
        """The reader thread: outputs, rejections, stats and replies from the replica, until the pipe ends."""
        while True:
            try:
                message = decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            except Exception:  # a message that does not decode: a bug, but never a reason to hang
                logger.exception("Engine replica %d sent a message that does not load", self.index)
                continue
            try:
                self._dispatch(message)
            except Exception:
                logger.exception("Engine replica %d: handling %r failed", self.index, message[0])
        if not self._closing:
            self._died()

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            outputs: list[EngineCoreOutput] = message[1]
            self.in_flight.difference_update(o.request_id for o in outputs if o.finished)
            self.outputs.put(outputs)
        elif kind == "stats":
            self.last_stats = message[1]
        elif kind == "result":
            _, call_id, value = message
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                future.set_result(value)
        elif kind == "engine_dead":
            self._died(f"Engine replica {self.index} (pid {self.pid}): its engine stopped: {message[1]}")

    def _watch(self) -> None:
        """The monitor thread: the process's exit, whatever its cause."""
        wait_for([self.child_process.sentinel])
        if not self._closing:
            self._died()

    def _exit_description(self) -> str:
        code = self.child_process.exitcode
        if code is None:
            return "exit code unknown"
        if code < 0:
            try:
                return f"exit code {code}, killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"exit code {code}"
        return f"exit code {code}"

    def _died(self, reason: Optional[str] = None) -> None:
        with self._state_lock:  # one thread reaps the process and tells; the others find it told
            if self.dead is not None:
                return
            if reason is None:
                deadline = time.monotonic() + 1.0  # the pipe may end a moment before the process is reaped
                while self.child_process.exitcode is None and time.monotonic() < deadline:
                    self.child_process.join(0.05)
                reason = f"Engine replica {self.index} (pid {self.pid}) died ({self._exit_description()})"
            self.dead = EngineDeadError(f"{reason}; the server must be restarted.")
        logger.error("%s", self.dead)
        report_death(self.on_dead, self.dead)
        self._fail_calls(self.dead)
        self.outputs.put(None)  # wake the front-end: its step() raises

    def _fail_calls(self, error: EngineDeadError) -> None:
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(str(error)))


def next_outputs(outputs: queue.SimpleQueue, check_alive: Callable[[], None]) -> list[EngineCoreOutput]:
    """Everything in `outputs` now, after waiting for the first entry (a list of outputs, or None to wake);
    `check_alive()` raises first if a replica died."""
    check_alive()
    entries = [outputs.get()]
    while True:
        try:
            entries.append(outputs.get_nowait())
        except queue.Empty:
            break
    check_alive()
    return [output for entry in entries if entry is not None for output in entry]
