"""An engine replica in a local process of its own, and the client the server process talks to it with.

The child (`engine/replica_process.py`) builds `LLMEngine.from_options(model, **engine_options)`, wraps it
in an `AsyncEngine` and serves commands read from a `multiprocessing` Pipe: add a request and stream its
`RequestOutput`s back, abort one, process a prompt (for /tokenize), render a chat's text, and push a small
stats snapshot (`EngineCore.stats`: plain numbers) at most every `STATS_INTERVAL` seconds when it changed, and
at once when the replica goes idle. Messages are pickled tuples (`send_bytes(pickle.dumps(...))` under a
lock, so threads never interleave them).

`ReplicaClient` (the parent's side) presents what the server uses of `AsyncEngine`: `process()`,
`add_request()` returning a `RequestStream` (async iteration; the request aborts when the reader goes away;
`RequestFailedError` / `EngineDeadError`), `is_alive`, `dead`, `on_dead` callbacks and `shutdown()`. A monitor
thread watches the process's sentinel and the reader thread the pipe's end of file: a replica that dies
(killed, crashed) is seen within a second or so; its in-flight requests then fail with an `EngineDeadError`
that names the replica and its exit code, `is_alive` turns False and the `on_dead` callbacks run.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from multiprocessing.connection import wait as wait_for
from typing import Any, Optional

from ..sampling_params import SamplingParams
from .async_engine import EngineDeadError, RequestFailedError, RequestStream
from .prompt import PromptInputs
from .replica_process import dumps, replica_main

logger = logging.getLogger(__name__)

# ---- the parent's side ---------------------------------------------------------------------------------------


class ReplicaStream(RequestStream):
    """A request's outputs from a replica: RequestStream's semantics, aborting through the pipe."""

    def __init__(self, client: "ReplicaClient", request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(client, request_id, loop)  # type: ignore[arg-type]
        self.client = client

    def abort(self) -> None:
        self.finished = True
        self.client._abort(self.request_id)


_LIVE_CLIENTS: "weakref.WeakSet[ReplicaClient]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_clients() -> None:  # before multiprocessing joins its children at exit
    for client in list(_LIVE_CLIENTS):
        client.shutdown(timeout=2.0)


class ReplicaClient:
    """One replica process (started at once; `wait_ready()` waits for its engine) and its requests."""

    def __init__(
        self,
        index: int,
        model: str,
        engine_options: Optional[Mapping[str, Any]] = None,
        *,
        num_threads: Optional[int] = None,
    ) -> None:
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
        self.info: dict[str, Any] = {}
        self.dead: Optional[EngineDeadError] = None
        self.on_dead: list[Callable[[BaseException], None]] = []
        self.last_stats: dict[str, int] = {}
        self._streams: dict[str, ReplicaStream] = {}
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._closing = False  # stopping on purpose: the process's end is no death
        self._shut = False
        self._threads: list[threading.Thread] = []
        _LIVE_CLIENTS.add(self)

    def wait_ready(self, timeout: Optional[float] = None) -> dict[str, Any]:
        """Wait until the replica's engine is built; its start-up info. A replica that fails to start
        raises RuntimeError with the child's error (it is stopped)."""
        ready = wait_for([self._conn, self.child_process.sentinel], timeout)
        message: Any = None
        if self._conn in ready:
            try:
                message = pickle.loads(self._conn.recv_bytes())
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
        self.info = message[1]
        self.last_stats = dict(self.info.get("stats", {}))
        for target, name in ((self._read, "reader"), (self._watch, "monitor")):
            thread = threading.Thread(target=target, name=f"tessera-replica-{self.index}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self.info

    # ---- what the server uses ------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self.dead is None and not self._closing and self.child_process.exitcode is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def process(self, prompt: Any, params: Optional[SamplingParams] = None) -> PromptInputs:
        """The prompt processed by the replica (its processor cache); bad input raises ValueError."""
        return await self.call("process", prompt, params or SamplingParams())

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> ReplicaStream:
        """Process and queue a prompt on the replica; bad input raises ValueError here, before anything is queued."""
        self._check_alive()
        stream = ReplicaStream(self, request_id, asyncio.get_running_loop())
        self._streams[request_id] = stream  # in flight from now on (the router counts it)
        try:
            await self.call("add", request_id, prompt, params)
        except asyncio.CancelledError:  # the caller went away; the add may still run: undo it
            stream.abort()
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def stats(self) -> dict[str, int]:
        """A fresh stats snapshot (also kept as `last_stats`)."""
        self.last_stats = await self.call("stats")
        return self.last_stats

    async def call(self, kind: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self._request(kind, *args))

    def call_sync(self, kind: str, *args: Any, timeout: Optional[float] = 60.0) -> Any:
        """A command's result, waiting on this thread (never call it on an event loop's thread)."""
        return self._request(kind, *args).result(timeout)

    def abort_all(self, message: str) -> None:
        """End every request in flight on this replica: their streams raise `RequestFailedError(message, 503)`
        at once and the replica frees them."""
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            stream.put(RequestFailedError(message, 503))
            if self.is_alive:
                try:
                    self._send(("abort", request_id))
                except EngineDeadError:
                    pass

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
        error = EngineDeadError(f"Engine replica {self.index} was shut down.")
        self._fail_all(error)

    # ---- internals -----------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        if not self.is_alive:
            raise EngineDeadError(f"Engine replica {self.index} has stopped.")

    def _send(self, message: tuple) -> None:
        data = dumps(message)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError) as e:  # the pipe is gone: the replica died
            if not self._closing:
                threading.Thread(target=self._died, daemon=True).start()
            raise EngineDeadError(f"Engine replica {self.index} is unreachable: {e!r}") from None

    def _request(self, kind: str, *args: Any) -> Future:
        self._check_alive()
        call_id = next(self._ids)
        future: Future = Future()
        self._calls[call_id] = future
        try:
            self._send((kind, call_id, *args))
        except BaseException:
            self._calls.pop(call_id, None)
            raise
        if self.dead is not None and self._calls.pop(call_id, None) is not None:  # died meanwhile
            future.set_exception(EngineDeadError(str(self.dead)))
        return future

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None or not self.is_alive:
            return
        try:
            self._send(("abort", request_id))
        except EngineDeadError:
            pass

    def _read(self) -> None:
        """The reader thread: replies, outputs and stats from the replica, until the pipe ends."""
        while True:
            try:
                message = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            except Exception:  # a message that does not unpickle: a bug, but never a reason to hang
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
        if kind == "out":
            _, request_id, output = message
            stream = self._streams.get(request_id)
            if stream is None:
                return
            if output.finished:
                self._streams.pop(request_id, None)
            if not stream.put(output) and not output.finished:  # its reader is gone: stop it
                self._abort(request_id)
        elif kind == "error":
            _, request_id, what, text = message
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                error_type = RequestFailedError if what == "failed" else EngineDeadError
                stream.put(error_type(text if what == "failed" else f"Engine replica {self.index}: {text}"))
        elif kind == "result":
            _, call_id, ok, value = message
            future = self._calls.pop(call_id, None)
            if future is None or future.done():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        elif kind == "stats":
            self.last_stats = message[1]
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
        for callback in self.on_dead:  # first, so that whoever sees a stream fail sees them done
            try:
                callback(self.dead)
            except Exception:
                logger.exception("An on_dead callback failed")
        self._fail_all(self.dead)

    def _fail_all(self, error: EngineDeadError) -> None:
        streams, self._streams = self._streams, {}
        calls, self._calls = self._calls, {}
        for stream in streams.values():
            stream.put(EngineDeadError(str(error)))
        for future in calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(str(error)))
