"""Every way of running the engine core gives the same tokens for the same mixed image / video / text
requests: in-process (the offline `LLM`), on the server's engine thread (`AsyncEngine`), in a child process
(`ReplicaClient`) and over two data-parallel replicas (`DataParallelClient`). With replicas, the front-end
processes every prompt (each item hashed once, in this process) and sends a replica nothing but the
processed request."""

from __future__ import annotations

import asyncio

import pytest

from tessera import LLM, SamplingParams
from tessera.config import engine_configs
from tessera.engine.async_engine import AsyncEngine
from tessera.engine.executor.data_parallel import DataParallelClient
from tessera.engine.executor.replica import ReplicaClient
from tessera.engine.llm_engine import LLMEngine
from tessera.multimodal.hasher import MultiModalHasher
from tessera.multimodal.video import decode_video
from testkit import random_images, video_bytes
from testkit.qwen_vl import build_tiny_qwen2_vl

OPTIONS = {"kv_cache_memory": "16MiB"}
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("core_clients_qwen2_vl"))


def mixed_prompts() -> list:
    images = random_images([(60, 40), (40, 60)], seed=3)
    clip = decode_video(video_bytes(num_frames=4, width=32, height=32, fps=4)).frames
    user = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    return [
        {"prompt": user.format(f"{IMAGE} What is this?"), "multi_modal_data": {"image": images[0]}},
        {"prompt": user.format(f"{VIDEO} What happens?"), "multi_modal_data": {"video": [clip]}},
        user.format("Say something."),
        {"prompt": user.format(f"{IMAGE}{VIDEO} Both?"), "multi_modal_data": {"image": images[1], "video": [clip]}},
        {"prompt": user.format(f"{IMAGE} Again?"), "multi_modal_data": {"image": images[0]}},
    ]


def drive(engine: LLMEngine, prompts: list, params: SamplingParams) -> list[list[int]]:
    """Add every prompt, step until all finish; greedy tokens in prompt order."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    finished = {}
    while len(finished) < len(prompts):
        for output in engine.step():
            if output.finished:
                assert output.error is None, output.error
                finished[output.request_id] = output.outputs[0].token_ids
    return [finished[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def expected(qwen2_vl_dir):
    outputs = LLM(str(qwen2_vl_dir), **OPTIONS).generate(mixed_prompts(), GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_the_engine_thread_gives_the_in_process_tokens(qwen2_vl_dir, expected):
    engine = AsyncEngine(LLMEngine(*engine_configs(str(qwen2_vl_dir), **OPTIONS)))
    try:

        async def run():
            async def one(i, prompt):
                stream = await engine.add_request(f"r{i}", prompt, GREEDY)
                return [o async for o in stream][-1].outputs[0].token_ids

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(mixed_prompts())))

        assert asyncio.run(run()) == expected
    finally:
        engine.shutdown()


def test_a_core_in_a_child_process_gives_the_in_process_tokens(qwen2_vl_dir, expected):
    replica = ReplicaClient(0, str(qwen2_vl_dir), OPTIONS, num_threads=1)
    try:
        replica.wait_ready(timeout=300)
        engine = LLMEngine(*engine_configs(str(qwen2_vl_dir), **OPTIONS), core=replica)
        assert drive(engine, mixed_prompts(), GREEDY) == expected
        assert not replica.in_flight
    finally:
        replica.shutdown()


def test_two_replicas_give_the_in_process_tokens_and_each_item_is_hashed_once(qwen2_vl_dir, expected, monkeypatch):
    client = DataParallelClient(str(qwen2_vl_dir), OPTIONS, 2)
    try:
        engine = LLMEngine(*engine_configs(str(qwen2_vl_dir), **OPTIONS), core=client)
        sent, hashed = [], []
        for replica in client.replicas:
            send = replica._send
            monkeypatch.setattr(replica, "_send", lambda message, send=send: sent.append(message[0]) or send(message))
        hash_kwargs = MultiModalHasher.hash_kwargs
        monkeypatch.setattr(MultiModalHasher, "hash_kwargs",
                            staticmethod(lambda **kw: hashed.append(list(kw)) or hash_kwargs(**kw)))  # fmt: skip
        before = client.refresh_stats()
        prompts = mixed_prompts()
        assert drive(engine, prompts, GREEDY) == expected
        after = client.refresh_stats()
        # the front-end hashed each item once (5 items in 4 prompts; the repeated image is hashed again, as a
        # new request's item) and sent the replicas nothing but the requests (and the stats asked for here)
        assert len(hashed) == 5
        assert [kind for kind in sent if kind != "stats"] == ["add"] * len(prompts)
        for old, new in zip(before, after):  # the replicas ran no processor
            assert new["processor_cache_queries"] == old["processor_cache_queries"]
        assert sum(new["prefix_cache_queries"] > old["prefix_cache_queries"] for old, new in zip(before, after)) == 2
        assert not client.owner and engine.stats()["kv_blocks_used"] == 0
    finally:
        client.shutdown()
