"""A server on 127.0.0.1 (free port) with the bundled demo model, shared by the server and web page tests."""

from __future__ import annotations

import base64
import re
import time
from pathlib import Path

import httpx
import pytest

from tessera import DEMO_MODEL
from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.entrypoints.openai.api_server import ServerThread, build_app
from tessera.multimodal.media import MediaPolicy

REPO = Path(__file__).resolve().parents[2]

API_KEY = "test-key"
MAX_IMAGES = 2
FETCH_DEADLINE = 3.0  # seconds, of the lan_server


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="session")
def demo_engine():
    engine = AsyncEngine(
        LLMEngine.from_options(str(DEMO_MODEL), kv_cache_memory="64MiB", limit_mm_per_prompt={"image": MAX_IMAGES})
    )
    yield engine
    engine.shutdown()


def serve_demo(engine, media_policy, head_timeout=10.0, **options):
    """A server over `engine` (apps can share one engine): API key required, at most 2 images per
    prompt, 1 MiB body cap."""
    app = build_app(engine, model_name="demo", api_key=API_KEY, media_policy=media_policy,
                    max_images_per_prompt=MAX_IMAGES, max_request_bytes=2**20, **options)  # fmt: skip
    return ServerThread(app, head_timeout=head_timeout)


@pytest.fixture(scope="session")
def server(demo_engine, media_dir):
    """(base URL, AsyncEngine) of a running server with the default media policy (public http(s)
    URLs only), local files only from media_dir."""
    with serve_demo(demo_engine, MediaPolicy(allowed_local_dir=media_dir, fetch_urls=True)) as url:
        yield url, demo_engine


@pytest.fixture(scope="session")
def lan_server(demo_engine):
    """The same engine served with private addresses allowed (for URLs of test servers on
    127.0.0.1), a 3 s total fetch deadline and 3 download slots."""
    policy = MediaPolicy(fetch_urls=True, allow_private_networks=True, timeout=FETCH_DEADLINE)
    with serve_demo(demo_engine, policy, max_concurrent_fetches=3) as url:
        yield url, demo_engine


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def data_url(path: Path, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_until_idle(url: str, timeout: float = 30.0) -> None:
    """Poll /metrics until no KV block is in use and nothing runs or waits (or fail after timeout)."""
    deadline = time.monotonic() + timeout
    names = ("tessera_kv_blocks_used", "tessera_requests_running", "tessera_requests_waiting")
    while any(metric(url, n) for n in names):
        assert time.monotonic() < deadline, {n: metric(url, n) for n in names}
        time.sleep(0.02)
