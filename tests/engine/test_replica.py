"""An engine replica in its own process behaves as the in-process AsyncEngine does: the same greedy
outputs, step by step; bad input fails alone, before anything is queued; a reader that leaves aborts its
request. A replica killed mid-generation fails its requests at once with an error naming it, and a
replica that cannot start says why."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tessera import LLM, SamplingParams
from tessera.engine.async_engine import EngineDeadError, RequestFailedError
from tessera.engine.replica import ReplicaClient
from tessera.testing import random_images

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


@pytest.fixture(scope="module")
def replica(tiny_llava_dir):
    client = ReplicaClient(0, str(tiny_llava_dir), {"kv_cache_memory": "16MiB"}, num_threads=1)
    client.wait_ready(timeout=300)
    yield client
    client.shutdown()
    assert client.child_process.exitcode is not None


def prompts():
    images = random_images([(40, 30), (30, 40)], seed=11)
    return [{"prompt": PROMPT, "multi_modal_data": {"image": image}} for image in images] + ["A plain text prompt"]


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_outputs_match_the_offline_api_and_arrive_step_by_step(replica, tiny_llava_dir):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def run_all():
        async def one(i, prompt):
            stream = await replica.add_request(f"r{i}", prompt, params)
            return [o async for o in stream]

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts())))

    results = asyncio.run(run_all())
    expected = LLM(str(tiny_llava_dir), kv_cache_memory="16MiB").generate(prompts(), params, use_tqdm=False)
    for outputs, reference in zip(results, expected):
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1]) and len(outputs) > 1
        assert outputs[-1].outputs[0].token_ids == reference.outputs[0].token_ids
        assert outputs[-1].outputs[0].text == reference.outputs[0].text
    assert replica.num_in_flight == 0
    assert replica.info["max_model_len"] > 0 and replica.info["chat_template"]


def test_process_and_bad_input(replica):
    async def run():
        inputs = await replica.process(prompts()[0])
        good = await replica.add_request("good", "Hello", SamplingParams(max_tokens=4, ignore_eos=True))
        with pytest.raises(ValueError, match="context"):
            await replica.add_request("bad", "word " * 10_000, SamplingParams())
        return inputs, [o async for o in good]

    inputs, outputs = asyncio.run(run())
    assert len(inputs.mm_items) == 1 and inputs.mm_items[0].modality == "image"
    assert len(outputs[-1].outputs[0].token_ids) == 4
    assert replica.num_in_flight == 0 and replica.is_alive


def test_a_reader_that_leaves_aborts_its_request(replica):
    async def run():
        stream = await replica.add_request("long", "Hello", SamplingParams(max_tokens=3000, ignore_eos=True))
        async for _ in stream:
            break  # the generator closes: the request is aborted on the replica

    asyncio.run(run())
    assert replica.num_in_flight == 0
    wait_for(lambda: asyncio.run(replica.stats())["running"] == 0)
    assert replica.last_stats["kv_blocks_used"] == 0


def test_abort_all_ends_every_stream_with_a_503_and_frees_the_replica(replica):
    async def run():
        streams = [await replica.add_request(f"all{i}", "Hello", SamplingParams(max_tokens=3000, ignore_eos=True))
                   for i in range(2)]  # fmt: skip
        streams = [aiter(stream) for stream in streams]  # one reader each: a dropped reader aborts its request
        first = [await anext(stream) for stream in streams]
        replica.abort_all("shutting down")
        errors = []
        for stream in streams:
            with pytest.raises(RequestFailedError, match="shutting down") as caught:
                async for _ in stream:
                    pass
            errors.append(caught.value.status_code)
        return first, errors

    first, errors = asyncio.run(run())
    assert not any(o.finished for o in first) and errors == [503, 503]
    assert replica.num_in_flight == 0 and replica.is_alive
    wait_for(lambda: asyncio.run(replica.stats())["running"] == 0)
    assert replica.last_stats["kv_blocks_used"] == 0


def test_a_replica_that_cannot_start_says_why(tmp_path):
    client = ReplicaClient(3, str(tmp_path / "no-such-model"), {"kv_cache_memory": "16MiB"}, num_threads=1)
    with pytest.raises(ValueError, match="Engine replica 3 failed to start: Model folder .* has no config.json"):
        client.wait_ready(timeout=300)
    assert client.child_process.exitcode is not None


def test_a_killed_replica_fails_its_requests_at_once(replica):  # last: it kills the module's replica
    died = []
    replica.on_dead.append(died.append)

    async def run():
        params = SamplingParams(max_tokens=3000, ignore_eos=True)
        streams = [await replica.add_request(f"k{i}", "Hello", params) for i in range(2)]
        first = streams[0].__aiter__()
        await first.__anext__()  # generating
        os.kill(replica.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        errors = []
        for stream in (first, streams[1].__aiter__()):
            with pytest.raises(EngineDeadError) as caught:
                while True:
                    await asyncio.wait_for(stream.__anext__(), timeout=5)
            errors.append(str(caught.value))
        return errors, time.monotonic() - killed_at

    errors, seconds = asyncio.run(run())
    assert seconds < 2
    for error in errors:
        assert "Engine replica 0" in error and "SIGKILL" in error, error
    assert not replica.is_alive and len(died) == 1 and "replica 0" in str(died[0])
    with pytest.raises(EngineDeadError, match="replica 0"):
        asyncio.run(replica.add_request("late", "Hello", SamplingParams()))
