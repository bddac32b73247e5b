"""Helpers for tests and benchmarks that run the OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import base64
import re
import time
from pathlib import Path

API_KEY = "test-key"
MAX_IMAGES = 2
FETCH_DEADLINE = 3.0  # seconds, of the tests' lan_server


def serve_demo(engine, media_policy, head_timeout=10.0, **options):
    """A server over `engine` (apps can share one engine): API key required, at most 2 images per
    prompt, 1 MiB body cap."""
    from tessera.entrypoints.openai.api_server import ServerThread, build_app

    app = build_app(engine, model_name="demo", api_key=API_KEY, media_policy=media_policy,
                    max_images_per_prompt=MAX_IMAGES, max_request_bytes=2**20, **options)  # fmt: skip
    return ServerThread(app, head_timeout=head_timeout)


def data_url(path: Path, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def metric(url: str, name: str, default: float | None = None) -> float:
    """A sample of /metrics; `default` when absent (a labelled counter appears at its first
    increment), else absence fails."""
    import httpx

    text = httpx.get(url + "/metrics").text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    if match is None and default is not None:
        return default
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_until_idle(url: str, timeout: float = 30.0) -> None:
    """Poll /metrics until no KV block is in use and nothing runs or waits (or fail after timeout)."""
    deadline = time.monotonic() + timeout
    names = ("tessera_kv_blocks_used", "tessera_requests_running", "tessera_requests_waiting")
    while any(metric(url, n) for n in names):
        assert time.monotonic() < deadline, {n: metric(url, n) for n in names}
        time.sleep(0.02)


def rss_bytes() -> int:
    """This process's resident memory (Linux)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
