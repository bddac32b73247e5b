"""`tessera serve` as an operator runs it: SIGTERM stops it within --shutdown-timeout, every stream
ending in-band (a finish_reason or an error event, then [DONE]) instead of a broken connection; with
data-parallel replicas too (they are shut down with it)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from testkit import build_tiny_text_model

SHUTDOWN_TIMEOUT = 1.0
SLACK = 8.0  # seconds beyond the timeout for the process to stop (interpreter exit, a loaded CI machine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """The process ids of a process's children (Linux)."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def _read_stream(url: str, body: dict, events: list, started: threading.Event) -> None:
    """Append each SSE data payload of one streamed completion to `events` (a broken connection appends
    the exception)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    started.set()
    except Exception as e:  # what the test asserts never happens
        events.append(e)
    finally:
        started.set()


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """A tiny model whose context takes streams far longer than the shutdown timeout."""
    folder = tmp_path_factory.mktemp("long_context")
    return build_tiny_text_model(folder, LlamaForCausalLM, LlamaConfig, max_position_embeddings=1 << 16)


@pytest.mark.parametrize("replicas", [1, 2], ids=["one-engine", "data-parallel"])
def test_sigterm_ends_every_stream_in_band_and_exits_within_the_timeout(long_context_model, replicas):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "tessera.entrypoints.cli", "serve", str(long_context_model), "--port", str(port),
               "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--kv-cache-memory", "64MiB",
               "--data-parallel-size", str(replicas)]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)

        long = {"model": long_context_model.name, "prompt": "hello world", "max_tokens": 60000, "ignore_eos": True,
                "stream": True, "temperature": 0}  # fmt: skip
        short = {**long, "max_tokens": 2}
        streams = []
        for body in (long, long, long, long, short):
            events: list = []
            started = threading.Event()
            thread = threading.Thread(target=_read_stream, args=(url, body, events, started), daemon=True)
            thread.start()
            streams.append((body, events, started, thread))
        for _, _, started, _ in streams:
            assert started.wait(60), "a stream sent nothing"

        children = _children(server.pid)  # the replicas' processes, with data parallelism
        assert len(children) >= (replicas if replicas > 1 else 0)
        sent = time.monotonic()
        server.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the listener closes at once: a new connection is refused
        with pytest.raises(httpx.TransportError):
            httpx.post(url + "/v1/completions", json={**short, "stream": False}, timeout=5)
        for _, _, _, thread in streams:
            thread.join(SHUTDOWN_TIMEOUT + SLACK)
        status = server.wait(timeout=SHUTDOWN_TIMEOUT + SLACK)
        took = time.monotonic() - sent
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    output = server.stdout.read()
    assert status == 0, output
    assert took < SHUTDOWN_TIMEOUT + SLACK, took
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() for pid in children):  # none left behind
        assert time.monotonic() < deadline, [pid for pid in children if Path(f"/proc/{pid}").exists()]
        time.sleep(0.05)

    for body, events, _, _ in streams:
        assert not any(isinstance(e, Exception) for e in events), (events[-3:], output)
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        if body["max_tokens"] == 2:  # finished before the deadline: its own finish reason
            assert last["choices"][0]["finish_reason"] == "length", last
        else:  # 60000 tokens cannot finish within a second: ended by the deadline, with an error event
            assert last["error"]["code"] == 503, last
            assert "shutting down" in last["error"]["message"], last
            assert len(events) > 3  # it had streamed tokens before

