"""A server on 127.0.0.1 (free port) with the bundled demo model, shared by the server and web page tests."""

from __future__ import annotations

import pytest

from tessera import TINY_DEMO_MODEL
from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.multimodal.media import MediaPolicy
from testkit.server import API_KEY, FETCH_DEADLINE, MAX_IMAGES, serve_demo


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="session")
def demo_engine():
    engine = AsyncEngine(
        LLMEngine.from_options(str(TINY_DEMO_MODEL), kv_cache_memory="64MiB", limit_mm_per_prompt={"image": MAX_IMAGES})
    )
    yield engine
    engine.shutdown()


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
