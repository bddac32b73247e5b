"""The replica process's side of `engine/executor/replica.py`: build the `EngineCore`, say "ready" with its start-up
info, then step it while it has work, taking the parent's commands from the pipe between steps, until told
to stop or until the parent goes away. Messages both ways are tuples, as msgpack without pickle
(`serial_utils`):

parent -> child: ("add", EngineCoreRequest), ("abort", ids, stopped), ("stats", call_id), ("shutdown",)
child -> parent: ("ready", EngineCoreInfo, stats), ("failed", text, traceback, bad_input),
                 ("outputs", [EngineCoreOutput]), ("stats", stats), ("result", call_id, stats),
                 ("engine_dead", text)
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ...errors import InputError
from ...outputs import RequestMetrics
from ..core.core_io import EngineCoreOutput, EngineCoreRequest
from ..core.request import RequestStatus
from .serial_utils import decode, encode

STATS_INTERVAL = 0.25  # seconds: the most often a replica pushes its stats while busy


def replica_main(conn: Connection, index: int, model: str, engine_options: dict[str, Any], num_threads: int) -> None:
    """The replica process: build the core, say "ready", serve until told to stop or until the parent goes
    away (end of file on the pipe)."""
    import torch

    torch.set_num_threads(num_threads)  # N replicas share the cores instead of oversubscribing them
    lock = threading.Lock()

    def send(message: tuple) -> None:
        data = encode(message)
        with lock:
            conn.send_bytes(data)

    try:
        from ...config import engine_configs
        from .local_core import start_core

        core = start_core(*engine_configs(model, **engine_options))
    except BaseException as e:
        try:
            bad_input = isinstance(e, (ValueError, OSError))
            send(("failed", str(e) if bad_input else f"{type(e).__name__}: {e}", traceback.format_exc(), bad_input))
        finally:
            os._exit(1)
    try:
        send(("ready", core.info, core.stats()))
        _serve(conn, core, send)
    except (EOFError, OSError):  # the parent went away
        pass
    finally:
        core.shutdown()
    os._exit(0)  # not waiting on threads of a finished core


def _serve(conn: Connection, core: Any, send: Callable[[tuple], None]) -> None:
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                inbox.put(decode(conn.recv_bytes()))
            except (EOFError, OSError):  # the parent went away: stop
                inbox.put(("shutdown",))
                return

    threading.Thread(target=read, name="tessera-replica-reader", daemon=True).start()
    last_stats, last_push = core.stats(), time.monotonic()
    while True:
        try:  # between steps, whatever came; when idle, wait for it
            message = inbox.get_nowait() if core.has_unfinished_requests() else inbox.get()
        except queue.Empty:
            message = None
        while message is not None:
            if not _handle(message, core, send):
                return
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                message = None
        if core.has_unfinished_requests():
            try:
                outputs = core.step()
            except BaseException as e:  # the core's own state is broken: the parent fails its requests
                send(("engine_dead", f"{type(e).__name__}: {e}"))
                raise SystemExit(1) from e
            if outputs:
                send(("outputs", [_light(o) for o in outputs]))
        now, idle = time.monotonic(), not core.has_unfinished_requests()
        if idle or now - last_push >= STATS_INTERVAL:
            stats = core.stats()
            if stats != last_stats:
                send(("stats", stats))
                last_stats, last_push = stats, now


def _handle(message: tuple, core: Any, send: Callable[[tuple], None]) -> bool:
    """Run one command; False to stop."""
    kind = message[0]
    if kind == "add":
        request: EngineCoreRequest = message[1]
        try:
            core.add_request(request)
        except Exception as e:  # the front-end checked it; whatever is left fails this request alone
            status = 400 if isinstance(e, InputError) else 500
            metrics = RequestMetrics(arrival_time=request.arrival_time or time.monotonic())
            failed = EngineCoreOutput(request.request_id, [], None, metrics, RequestStatus.FINISHED_ERROR,
                                      error=str(e), error_status=status)  # fmt: skip
            send(("outputs", [failed]))
    elif kind == "abort":
        _, ids, stopped = message
        core.abort(ids, stopped=stopped)
    elif kind == "stats":
        send(("result", message[1], core.stats()))
    elif kind == "shutdown":
        return False
    return True


def _light(output: EngineCoreOutput) -> EngineCoreOutput:
    """The output as sent: a running sequence's metrics without its token times (they grow with every token;
    the last output carries them all)."""
    if output.finished:
        return output
    return dataclasses.replace(output, metrics=dataclasses.replace(output.metrics, token_times=[]))
