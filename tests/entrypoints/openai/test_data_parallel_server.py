"""The server over two data-parallel replicas (`tessera serve --data-parallel-size 2`): the same answers
as one in-process engine; a request repeating an image goes to the replica that has it cached (its
prefix-cache hits, per replica in /metrics too); a replica killed mid-generation fails its requests with
an error naming it and /health turns 503 at once."""

from __future__ import annotations

import base64
import io
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.entrypoints.openai.api_server import ServerThread, build_app
from testkit import random_images
from testkit.server import metric, wait_until_idle

OPTIONS = {"kv_cache_memory": "16MiB"}


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def dp_engine(tiny_llava_dir):
    engine = AsyncEngine(LLMEngine.data_parallel(str(tiny_llava_dir), OPTIONS, 2))
    yield engine
    engine.shutdown()
    assert all(replica.child_process.exitcode is not None for replica in replicas(engine))  # none left behind


def replicas(engine):
    return engine.engine.core.replicas


@pytest.fixture(scope="module")
def dp_url(dp_engine):
    with ServerThread(build_app(dp_engine, model_name="tiny")) as url:
        yield url


@pytest.fixture(scope="module")
def single_url(tiny_llava_dir):
    engine = AsyncEngine(LLMEngine.from_options(str(tiny_llava_dir), **OPTIONS))
    try:
        with ServerThread(build_app(engine, model_name="tiny")) as url:
            yield url
    finally:
        engine.shutdown()


def mixed_requests() -> list[tuple[str, dict]]:
    """16 greedy requests: chat and completions, text-only and with images, some repeating an image."""
    urls = [data_url(image) for image in random_images([(40, 30), (30, 40), (36, 36)], seed=21)]
    greedy = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    requests = []
    for i in range(16):
        image = urls[i % 3]
        if i % 4 == 0:
            body = {"messages": [{"role": "user", "content": f"Say something about {i}."}]}
        elif i % 4 == 1:
            content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": f"What is {i}?"}]
            body = {"messages": [{"role": "user", "content": content}]}
        elif i % 4 == 2:
            body = {"prompt": f'USER: <img src="{image}">\nDescribe {i}. ASSISTANT:'}
        else:
            body = {"prompt": f"Count to {i}:"}
        requests.append(("/v1/chat/completions" if "messages" in body else "/v1/completions", {**body, **greedy}))
    return requests


def answer(url: str, path: str, body: dict) -> str:
    response = httpx.post(url + path, json={"model": "tiny", **body}, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_two_replicas_answer_as_one_engine(dp_url, single_url):
    requests = mixed_requests()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda r: answer(dp_url, *r), requests))
    expected = [answer(single_url, *r) for r in requests]
    assert got == expected
    assert any(got)


def test_both_replicas_serve_and_the_gauges_sum_them(dp_engine, dp_url):
    wait_until_idle(dp_url)
    per_replica = dp_engine.replica_stats()
    assert all(s["prefix_cache_queries"] > 0 for s in per_replica)  # the mixed requests reached both
    assert metric(dp_url, "tessera_kv_blocks_total") == sum(s["kv_blocks_total"] for s in per_replica)
    for i, s in enumerate(per_replica):
        hits = metric(dp_url, f'tessera_replica_prefix_cache_hits_total{{replica="{i}"}}')
        assert hits == s["prefix_cache_hits"]
    models = httpx.get(dp_url + "/v1/models").json()["data"][0]
    assert models["max_model_len"] == dp_engine.max_model_len
    tokens = httpx.post(dp_url + "/tokenize", json={"prompt": "Hello there"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0


def test_a_repeated_image_goes_to_the_replica_that_has_it(dp_engine, dp_url):
    image = data_url(random_images([(40, 30)], seed=99)[0])  # an image no replica has seen

    def ask(text: str) -> None:
        content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": text}]
        answer(dp_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "max_tokens": 2})

    wait_until_idle(dp_url)
    before = dp_engine.engine.core.refresh_stats()
    ask("What is this?")
    first = dp_engine.engine.core.refresh_stats()
    owner = next(i for i in range(2) if first[i]["prefix_cache_queries"] > before[i]["prefix_cache_queries"])
    other = 1 - owner
    for text in ("What is this?", "And now?", "Once more?"):  # the image's blocks are cached on the owner
        ask(text)
    after = dp_engine.engine.core.refresh_stats()
    assert after[owner]["prefix_cache_hits"] > first[owner]["prefix_cache_hits"]
    assert after[owner]["encoder_cache_queries"] >= first[owner]["encoder_cache_queries"]
    for key in ("prefix_cache_queries", "prefix_cache_hits"):
        assert after[other][key] == before[other][key], key  # the other replica saw none of them
    wait_until_idle(dp_url)
    scraped = metric(dp_url, f'tessera_replica_prefix_cache_hits_total{{replica="{owner}"}}')
    assert scraped == after[owner]["prefix_cache_hits"]


def test_serve_builds_replicas_with_the_engine_options(monkeypatch):
    """`serve(data_parallel_size=2)` hands the engine options, as a dict, to `LLMEngine.data_parallel`."""
    from tessera.entrypoints.openai import api_server

    seen = {}

    class Recorded(Exception):
        pass

    def record(model, engine_options, size):
        seen.update(model=model, options=engine_options, size=size)
        raise Recorded

    monkeypatch.setattr(LLMEngine, "data_parallel", record)
    with pytest.raises(Recorded):
        api_server.serve("/some/model", kv_cache_memory="16MiB", max_images_per_prompt=2, data_parallel_size=2)
    assert seen == {"model": "/some/model", "size": 2,
                    "options": {"kv_cache_memory": "16MiB", "limit_mm_per_prompt": {"image": 2}}}  # fmt: skip


def test_the_cli_passes_data_parallel_size(tiny_llava_dir, monkeypatch):
    from tessera.entrypoints import cli
    from tessera.entrypoints.openai import api_server

    seen = {}
    monkeypatch.setattr(api_server, "serve", lambda model, **options: seen.update(options) or 0)
    assert cli.main(["serve", str(tiny_llava_dir), "--data-parallel-size", "2"]) == 0
    assert seen["data_parallel_size"] == 2
    assert cli.main(["serve", str(tiny_llava_dir)]) == 0
    assert seen["data_parallel_size"] == 1


def test_a_killed_replica_fails_its_requests_and_health_turns_503(dp_engine, dp_url):  # last: it kills one
    wait_until_idle(dp_url)
    results = {}

    def long_request(name: str) -> None:
        body = {"model": "tiny", "prompt": f"Go on {name}", "max_tokens": 1000, "ignore_eos": True}
        results[name] = httpx.post(dp_url + "/v1/completions", json=body, timeout=60)

    threads = [threading.Thread(target=long_request, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while sum(s["in_flight"] for s in dp_engine.replica_stats()) < 2:  # one on each replica
        assert time.monotonic() < deadline
        time.sleep(0.01)
    victim = next(i for i, s in enumerate(dp_engine.replica_stats()) if s["in_flight"])
    os.kill(replicas(dp_engine)[victim].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while httpx.get(dp_url + "/health").status_code != 503:
        assert time.monotonic() - killed_at < 2, "/health still says ok"
        time.sleep(0.02)
    health = httpx.get(dp_url + "/health")
    assert health.json()["status"] == "dead"
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    failed = [r for r in results.values() if r.status_code != 200]
    assert failed, [r.status_code for r in results.values()]
    for response in failed:
        assert response.status_code == 503 and response.json()["error"]["type"] == "server_error"
        assert f"Engine replica {victim}" in response.json()["error"]["message"]
    assert not dp_engine.is_alive
