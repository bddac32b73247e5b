"""The engine on its own thread, driven from asyncio: concurrent requests batch together and
match the offline API; bad input fails alone; a dropped reader aborts its request."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tessera import LLM, SamplingParams
from tessera.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from tessera.engine.llm_engine import LLMEngine
from testkit import random_images

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


@pytest.fixture(scope="module")
def engine(tiny_llava_dir):
    engine = AsyncEngine(LLMEngine.from_options(str(tiny_llava_dir), kv_cache_memory="64MiB"))
    yield engine
    engine.shutdown()


def prompts():
    return [{"prompt": PROMPT, "multi_modal_data": {"image": image}} for image in random_images([(40, 30)] * 4, seed=5)]


def test_concurrent_requests_match_the_offline_api(engine, tiny_llava_dir):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def run_all():
        async def one(i, prompt):
            stream = await engine.add_request(f"r{i}", prompt, params)
            outputs = [o async for o in stream]
            return outputs

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts())))

    results = asyncio.run(run_all())
    expected = LLM(str(tiny_llava_dir), kv_cache_memory="64MiB").generate(prompts(), params, use_tqdm=False)
    for outputs, reference in zip(results, expected):
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        assert outputs[-1].outputs[0].token_ids == reference.outputs[0].token_ids
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == sorted(lengths) and len(outputs) > 1  # outputs arrive step by step


def test_bad_input_raises_before_queueing_and_others_continue(engine):
    async def run():
        good = await engine.add_request("good", prompts()[0], SamplingParams(max_tokens=4, ignore_eos=True))
        with pytest.raises(ValueError, match="context"):
            await engine.add_request("bad", "word " * 10_000, SamplingParams())  # longer than the context
        return [o async for o in good]

    outputs = asyncio.run(run())
    assert len(outputs[-1].outputs[0].token_ids) == 4


def test_a_reader_that_stops_early_aborts_its_request(engine):
    async def run():
        stream = await engine.add_request("early", prompts()[1], SamplingParams(max_tokens=200, ignore_eos=True))
        async with contextlib.aclosing(aiter(stream)) as outputs:
            async for _ in outputs:
                break  # the reader goes away after the first output
        return await engine.call(
            lambda: (engine.engine.has_unfinished_requests(), engine.engine.core.block_manager.num_free_blocks)
        )

    busy, free = asyncio.run(run())
    assert not busy and free == engine.engine.core.num_blocks


def test_abort_all_ends_every_stream_with_a_503_and_the_engine_serves_on(engine):
    async def run():
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        streams = [await engine.add_request(f"all{i}", prompt, params) for i, prompt in enumerate(prompts()[:2])]
        streams = [aiter(stream) for stream in streams]  # one reader each: a dropped reader aborts its request
        first = [await anext(stream) for stream in streams]
        engine.abort_all("shutting down")
        statuses = []
        for stream in streams:
            with pytest.raises(RequestFailedError, match="shutting down") as caught:
                async for _ in stream:
                    pass
            statuses.append(caught.value.status_code)
        after = await engine.add_request("after", prompts()[2], SamplingParams(max_tokens=3, ignore_eos=True))
        outputs = [o async for o in after]
        idle = await engine.call(
            lambda: (engine.engine.has_unfinished_requests(), engine.engine.core.block_manager.num_free_blocks)
        )
        return first, statuses, outputs, idle

    first, statuses, outputs, (busy, free) = asyncio.run(run())
    assert not any(o.finished for o in first) and statuses == [503, 503]
    assert len(outputs[-1].outputs[0].token_ids) == 3
    assert not busy and free == engine.engine.core.num_blocks


def test_a_request_whose_event_loop_closed_is_dropped_and_the_engine_lives_on(engine):
    async def start_and_leave():
        await engine.add_request("orphan", prompts()[2], SamplingParams(max_tokens=200, ignore_eos=True))

    asyncio.run(start_and_leave())  # the loop closes while the request runs: nobody can read it

    async def normal_request():
        stream = await engine.add_request("after", prompts()[3], SamplingParams(max_tokens=4, ignore_eos=True))
        outputs = [o async for o in stream]
        state = await engine.call(
            lambda: (engine.engine.has_unfinished_requests(), engine.engine.core.block_manager.num_free_blocks)
        )
        return outputs[-1], state

    last, (busy, free) = asyncio.run(normal_request())
    assert engine.is_alive and len(last.outputs[0].token_ids) == 4
    assert not busy and free == engine.engine.core.num_blocks


def test_a_model_failure_fails_its_request_and_the_engine_serves_on(engine, monkeypatch):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    execute = engine.engine.core.runner.execute
    failing = {"yes": True}

    def fail_first(*args):
        if failing.pop("yes", False):
            raise RuntimeError("injected")
        return execute(*args)

    monkeypatch.setattr(engine.engine.core.runner, "execute", fail_first)

    async def run():
        stream = await engine.add_request("doomed", prompts()[0], params)
        with pytest.raises(RequestFailedError, match="failed while running this request"):
            [o async for o in stream]
        stream = await engine.add_request("fine", prompts()[0], params)
        return [o async for o in stream][-1]

    assert len(asyncio.run(run()).outputs[0].token_ids) == 6
    assert engine.is_alive


def test_a_dead_engine_fails_every_stream_and_says_so(tiny_llava_dir, monkeypatch):
    """The engine's own state breaking (here the scheduler) is fatal: streams end with
    EngineDeadError, is_alive turns False, on_dead callbacks run, new requests are refused."""
    dead = AsyncEngine(LLMEngine.from_options(str(tiny_llava_dir), kv_cache_memory="16MiB"))
    told = []
    dead.on_dead.append(told.append)

    def broken():
        raise RuntimeError("scheduler bug")

    async def run():
        monkeypatch.setattr(dead.engine.core.scheduler, "schedule", broken)
        stream = await dead.add_request("r", prompts()[0], SamplingParams(max_tokens=4))
        with pytest.raises(EngineDeadError):
            [o async for o in stream]
        with pytest.raises(EngineDeadError):
            await dead.add_request("s", "USER: hi ASSISTANT:", SamplingParams(max_tokens=4))

    try:
        asyncio.run(run())
        assert not dead.is_alive and [str(e) for e in told] == ["scheduler bug"]
    finally:
        dead.shutdown()
