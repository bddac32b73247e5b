"""Routing over data-parallel replicas (no processes here: tests/engine/executor/test_replica.py,
tests/engine/test_core_clients.py and tests/entrypoints/openai/test_data_parallel_server.py run real ones):
a processed sequence's first item (its hash: the same pixels, or the same name in multi_modal_uuids, give
the same key) keys it to the replica that got that key before; sequences without items, and new keys, go to
the least loaded replica (ties to the lowest index). A dead replica is not routed around."""

from __future__ import annotations

import queue

import pytest

from tessera import SamplingParams
from tessera.engine.core.core_io import EngineCoreRequest
from tessera.engine.executor.data_parallel import DataParallelClient, Router, routing_key
from tessera.engine.llm_engine import LLMEngine, core_requests
from tessera.errors import EngineDeadError
from testkit import random_images

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
PARAMS = SamplingParams(max_tokens=1)


def image_prompt(image, **extra):
    return {"prompt": PROMPT.replace("<image>", "<image>" * (len(image) if isinstance(image, list) else 1)),
            "multi_modal_data": {"image": image}, **extra}  # fmt: skip


@pytest.fixture(scope="module")
def front_end(tiny_llava_dir):
    return LLMEngine.from_options(str(tiny_llava_dir), kv_cache_memory="16MiB")


def key(front_end, prompt):
    inputs = front_end.input_preprocessor.process(prompt, PARAMS)
    (request,) = core_requests("r", inputs, PARAMS, front_end.max_model_len, 0.0)
    return routing_key(request)


def test_equal_images_have_one_key_and_other_images_another(front_end):
    a, b = random_images([(40, 30), (40, 30)], seed=3)
    a_again = random_images([(40, 30)], seed=3)[0]  # the same pixels, another object
    first = key(front_end, image_prompt(a))
    assert first == key(front_end, image_prompt(a_again)) == key(front_end, image_prompt([a, b]))
    assert key(front_end, image_prompt(b)) != key(front_end, image_prompt(a))
    assert key(front_end, image_prompt([b, a])) == key(front_end, image_prompt(b))  # the first item keys it


def test_named_items_are_keyed_by_their_name_and_prompts_without_media_by_nothing(front_end):
    a, b = random_images([(40, 30), (40, 30)], seed=4)
    named = key(front_end, image_prompt(a, multi_modal_uuids={"image": ["cat-1"]}))
    assert named == key(front_end, image_prompt(b, multi_modal_uuids={"image": "cat-1"}))
    assert named != key(front_end, image_prompt(a))
    for prompt in ("text", [1, 2, 3], {"prompt": "text"}, {"prompt_token_ids": [1]}):
        assert key(front_end, prompt) is None


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
        self.index, self.requests, self.dead, self.in_flight = index, [], None, set()

    @property
    def num_in_flight(self):
        return len(self.in_flight)

    def add_request(self, request):
        self.requests.append(request.request_id)
        self.in_flight.add(request.request_id)

    def abort(self, ids, *, stopped=False):
        self.in_flight.difference_update(ids)

    def check_health(self):
        if self.dead is not None:
            raise self.dead


def fake_client(size):
    client = DataParallelClient.__new__(DataParallelClient)
    client.replicas = [FakeReplica(i) for i in range(size)]
    client.router, client.owner, client.dead, client.on_dead = Router(size), {}, None, []
    client.outputs = queue.SimpleQueue()
    return client


def sequence(front_end, request_id, prompt):
    inputs = front_end.input_preprocessor.process(prompt, PARAMS)
    (request,) = core_requests(request_id, inputs, PARAMS, front_end.max_model_len, 0.0)
    return request


def test_the_client_routes_by_image_and_counts_sequences_in_flight(front_end):
    client = fake_client(2)
    cat, dog = random_images([(40, 30), (40, 30)], seed=7)
    for request_id, prompt in [("cat-1", image_prompt(cat)), ("text-1", "hello"), ("dog-1", image_prompt(dog)),
                               ("text-2", "hello"), ("text-3", "hello"), ("cat-2", image_prompt(cat)),
                               ("dog-2", image_prompt(dog))]:  # fmt: skip
        client.add_request(sequence(front_end, request_id, prompt))
    assert client.replicas[0].requests == ["cat-1", "dog-1", "text-3", "cat-2", "dog-2"]
    assert client.replicas[1].requests == ["text-1", "text-2"]
    assert client.loads() == [5, 2] and client.has_unfinished_requests()
    client.abort(["cat-1", "text-1", "unknown"])
    assert client.loads() == [4, 1] and "cat-1" not in client.owner


def test_the_client_refuses_requests_once_a_replica_is_dead():
    client = fake_client(2)
    client.replicas[1].dead = EngineDeadError("Engine replica 1 (pid 1) died (exit code -9, killed by SIGKILL)")
    with pytest.raises(EngineDeadError, match="replica 1"):
        client.add_request(EngineCoreRequest("r", [1, 2], PARAMS))
    with pytest.raises(EngineDeadError, match="replica 1"):
        client.step()
    assert client.replicas[0].requests == client.replicas[1].requests == []  # a dead replica is not routed around
