"""Routing over data-parallel replicas (no processes here: tests/engine/test_replica.py and
tests/entrypoints/openai/test_data_parallel_server.py run real ones): a prompt's first image or video
keys it to the replica that got that key before; prompts without media, and new keys, go to the least
loaded replica (ties to the lowest index); a named item (multi_modal_uuids) is keyed by its name."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from tessera import SamplingParams
from tessera.engine.async_engine import EngineDeadError
from tessera.engine.data_parallel import DataParallelEngine, Router, routing_key
from tessera.engine.prompt import PromptInputs
from tessera.engine.request import MultiModalItem
from tessera.multimodal.video import VideoFrames
from tessera.testing import random_images, random_video

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


def image_prompt(image, **extra):
    return {"prompt": PROMPT, "multi_modal_data": {"image": image}, **extra}


def test_equal_images_have_one_key_and_other_images_another():
    a, b = random_images([(40, 30), (40, 30)], seed=3)
    a_again = random_images([(40, 30)], seed=3)[0]  # the same pixels, another object
    assert routing_key(image_prompt(a)) == routing_key(image_prompt(a_again)) == routing_key(image_prompt([a, b]))
    assert routing_key(image_prompt(b)) != routing_key(image_prompt(a))
    assert routing_key(image_prompt([b, a])) == routing_key(image_prompt(b))  # the first item keys the prompt


def test_named_items_are_keyed_by_their_name_and_prompts_without_media_by_nothing():
    a, b = random_images([(40, 30), (40, 30)], seed=4)
    named = routing_key(image_prompt(a, multi_modal_uuids={"image": ["cat-1"]}))
    assert named == routing_key(image_prompt(b, multi_modal_uuids={"image": "cat-1"})) == "uuid:image:cat-1"
    assert routing_key(image_prompt([a, b], multi_modal_uuids={"image": [None, "x"]})) == routing_key(image_prompt(a))
    for prompt in ("text", [1, 2, 3], {"prompt": "text"}, {"prompt_token_ids": [1]}, image_prompt([])):
        assert routing_key(prompt) is None


def test_videos_and_processed_prompts_have_keys():
    video = random_video(4, 32, 32, seed=1)
    key = routing_key({"prompt": "<video>", "multi_modal_data": {"video": video}})
    assert key is not None and key.startswith("video:")
    assert key == routing_key({"prompt": "<video>", "multi_modal_data": {"video": [video.copy()]}})
    decoded = VideoFrames(video, fps=10.0, duration=0.4, total_num_frames=4, frames_indices=(0, 1, 2, 3))
    assert routing_key({"prompt": "<video>", "multi_modal_data": {"video": [decoded]}}).startswith("video:")
    assert pickle.loads(pickle.dumps(decoded)).frames_indices == (0, 1, 2, 3)  # crosses to a replica as it is
    image = random_images([(40, 30)], seed=1)[0]
    both = routing_key({"prompt": "", "multi_modal_data": {"video": video, "image": image}})
    assert both == routing_key(image_prompt(image))  # images before videos
    item = MultiModalItem("image", "abc123", None, None)
    assert routing_key(PromptInputs("p", [1, 2], [item])) == "hash:abc123"
    assert routing_key(PromptInputs("p", [1, 2], [])) is None
    assert routing_key({"prompt": "", "multi_modal_data": {"image": object()}}) is None  # unhashable: no key


def test_router_keeps_keys_and_balances_the_rest():
    router = Router(3)
    assert router.route("a", [2, 0, 1]) == 1  # a new key: the least loaded
    assert router.route("a", [0, 5, 0]) == 1  # then where it went first, however loaded
    assert router.route(None, [1, 1, 1]) == 0  # ties: the lowest index
    assert router.route(None, [1, 0, 0]) == 1
    assert router.route("b", [0, 3, 0]) == 0
    assert router.route("c", [1, 1, 0], remember=False) == 2 and "c" not in router.keys
    with pytest.raises(ValueError):
        Router(0)


def test_router_forgets_the_least_recently_used_key():
    router = Router(2, max_keys=2)
    router.route("a", [0, 0])  # -> 0
    router.route("b", [1, 0])  # -> 1
    router.route("a", [5, 5])  # a is now the most recent
    router.route("c", [0, 1])  # -> 0; b is forgotten
    assert list(router.keys) == ["a", "c"]
    assert router.route("b", [3, 1]) == 1  # a new key again: the least loaded


class FakeReplica:
    def __init__(self, index):
        self.index, self.requests, self.is_alive, self.dead = index, [], True, None

    @property
    def num_in_flight(self):
        return len(self.requests)

    async def add_request(self, request_id, prompt, params):
        self.requests.append(request_id)  # counted before the first await, as ReplicaClient does
        await asyncio.sleep(0)
        return request_id


def fake_engine(size):
    engine = DataParallelEngine.__new__(DataParallelEngine)
    engine.replicas = [FakeReplica(i) for i in range(size)]
    engine.router, engine.dead, engine.on_dead = Router(size), None, []
    return engine


def test_the_engine_routes_by_image_and_counts_requests_in_flight():
    engine = fake_engine(2)
    cat, dog = random_images([(40, 30), (40, 30)], seed=7)
    params = SamplingParams(max_tokens=1)

    async def run():
        await engine.add_request("cat-1", image_prompt(cat), params)  # replica 0 (tie)
        await engine.add_request("text-1", "hello", params)  # replica 1 (least loaded)
        await engine.add_request("dog-1", image_prompt(dog), params)  # tie again: replica 0
        await engine.add_request("text-2", "hello", params)  # replica 1
        await engine.add_request("text-3", "hello", params)  # tie: replica 0
        await asyncio.gather(*(engine.add_request(f"cat-{i}", image_prompt(cat), params) for i in (2, 3)))
        await engine.add_request("dog-2", image_prompt(dog), params)

    asyncio.run(run())
    first = engine.replicas[0].requests
    assert first[:3] == ["cat-1", "dog-1", "text-3"] and set(first[3:5]) == {"cat-2", "cat-3"} and first[5] == "dog-2"
    assert engine.replicas[1].requests == ["text-1", "text-2"]


def test_the_engine_refuses_requests_once_a_replica_is_dead():
    engine = fake_engine(2)
    engine.replicas[1].is_alive = False
    engine.replicas[1].dead = EngineDeadError("Engine replica 1 (pid 1) died (exit code -9, killed by SIGKILL)")
    assert not engine.is_alive

    with pytest.raises(EngineDeadError, match="replica 1"):
        asyncio.run(engine.add_request("r", "hello", SamplingParams()))
    assert engine.replicas[0].requests == engine.replicas[1].requests == []  # a dead replica is not routed around
