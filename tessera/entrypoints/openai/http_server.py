"""Running the app under uvicorn, with the timeouts uvicorn lacks.

uvicorn closes idle keep-alive connections, but a connection that sends nothing at all, or
trickles its request head a byte at a time, is held open forever: enough of them exhaust the
server's file descriptors. `HeadTimeoutProtocol` gives every request head a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class HeadTimeoutProtocol(H11Protocol):
    """h11 with a deadline for each request head: from the connection's start, and again after
    each response, the client has `head_timeout` seconds to send a whole request line and headers."""

    head_timeout: float = 10.0
    _head_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole head arrived: the request is running
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_head_timer()  # keep-alive: the next request's head has a deadline too

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.transport.close()


def uvicorn_config(app: Any, *, head_timeout: float = 10.0, keep_alive: int = 5, **options: Any) -> uvicorn.Config:
    """A uvicorn config for the app with head and keep-alive timeouts (seconds)."""
    protocol = type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout": head_timeout})
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=keep_alive, **options)


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a deadline for the requests running at SIGTERM / SIGINT: uvicorn stops
    accepting connections at once and waits for the open ones; `drain_timeout` seconds after the signal,
    `end_requests()` ends whatever still runs (the server's streams then close with a final event), so
    the process exits within about that time instead of waiting for every stream's last token."""

    def __init__(self, config: uvicorn.Config, *, drain_timeout: float, end_requests: Callable[[], None]) -> None:
        super().__init__(config)
        self.drain_timeout = drain_timeout
        self.end_requests = end_requests
        self._deadline: Optional[threading.Timer] = None

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            logger.info("Shutting down: running requests have %.1f s to finish", self.drain_timeout)
            self._deadline = threading.Timer(self.drain_timeout, self._end_requests)
            self._deadline.daemon = True
            self._deadline.start()

    def _end_requests(self) -> None:
        try:
            self.end_requests()
        except Exception:
            logger.exception("Ending the running requests at shutdown failed")


class ServerThread:
    """Serve an app from a background thread on 127.0.0.1 (a free port unless given), e.g. for
    tests, benchmarks or a notebook: `with ServerThread(app) as url: ...`."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.url = f"http://{host}:{self.socket.getsockname()[1]}"
        config = uvicorn_config(app, log_level="warning", timeout_graceful_shutdown=1, **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("The server thread stopped during start-up")
            self.thread.join(0.01)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()
