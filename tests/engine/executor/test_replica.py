"""An engine core in its own process (`ReplicaClient`), driven by a front-end here, behaves as the in-process
core does: the same greedy outputs, step by step, with stop strings ended in the child; aborts free what they
held; a request the child cannot queue fails alone. A replica killed mid-generation makes the front-end's
next step raise an error naming it, at once, and a replica that cannot start says why."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tessera import LLM, SamplingParams
from tessera.config import engine_configs
from tessera.engine.core.core_io import EngineCoreRequest
from tessera.engine.executor.replica import ReplicaClient
from tessera.engine.llm_engine import LLMEngine
from tessera.errors import EngineDeadError
from tessera.sampling_params import StructuredOutputsParams
from testkit import random_images

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
OPTIONS = {"kv_cache_memory": "16MiB"}


@pytest.fixture(scope="module")
def replica(tiny_llava_dir):
    client = ReplicaClient(0, str(tiny_llava_dir), OPTIONS, num_threads=1)
    client.wait_ready(timeout=300)
    yield client
    client.shutdown()
    assert client.child_process.exitcode is not None


@pytest.fixture(scope="module")
def engine(replica, tiny_llava_dir):
    """A front-end here over the replica."""
    return LLMEngine(*engine_configs(str(tiny_llava_dir), **OPTIONS), core=replica)


def prompts():
    images = random_images([(40, 30), (30, 40)], seed=11)
    return [{"prompt": PROMPT, "multi_modal_data": {"image": image}} for image in images] + ["A plain text prompt"]


def run(engine, requests):
    """Add (id, prompt, params) requests and step until they finish: {id: [outputs]}."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    outputs: dict = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def test_outputs_match_the_offline_api_and_arrive_step_by_step(engine, replica, tiny_llava_dir):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = run(engine, [(f"r{i}", p, params) for i, p in enumerate(prompts())])
    expected = LLM(str(tiny_llava_dir), **OPTIONS).generate(prompts(), params, use_tqdm=False)
    for i, reference in enumerate(expected):
        outputs = results[f"r{i}"]
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1]) and len(outputs) > 1
        assert outputs[-1].outputs[0].token_ids == reference.outputs[0].token_ids
        assert outputs[-1].outputs[0].text == reference.outputs[0].text
    assert replica.num_in_flight == 0
    assert replica.info.max_model_len > 0 and engine.input_preprocessor.chat_template


def test_a_finished_request_stays_unfinished_until_its_last_output_is_taken(replica):
    """The reader thread marks a request done as its final output arrives; the front-end must still see it
    unfinished until step() hands that output out (else its loop ends and the output is lost)."""
    replica.add_request(EngineCoreRequest("quick", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
    deadline = time.monotonic() + 60
    while replica.num_in_flight:  # finished in the child, nothing taken here yet
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert replica.has_unfinished_requests()
    outputs = []
    while replica.has_unfinished_requests():
        outputs += replica.step()
    assert outputs[-1].request_id == "quick" and outputs[-1].finished
    assert sum(len(o.new_token_ids) for o in outputs) == 2


def test_a_stop_string_ends_the_sequence_in_the_child(engine, replica, tiny_llava_dir):
    free = replica.stats_now()["kv_blocks_used"]
    probe = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    text = run(engine, [("probe", "Hello", probe)])["probe"][-1].outputs[0].text
    stop = text.strip().split()[1] if len(text.split()) > 1 else text.strip()[1:3]
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, stop=[stop])
    final = run(engine, [("stopped", "Hello", params)])["stopped"][-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop and stop not in final.text
    assert len(final.token_ids) < 400 and replica.num_in_flight == 0
    assert replica.stats_now()["kv_blocks_used"] == free  # the child freed it


def test_an_abort_frees_the_sequence_in_the_child(engine, replica):
    engine.add_request("long", "Hello", SamplingParams(max_tokens=3000, ignore_eos=True))
    deadline = time.monotonic() + 30
    while replica.stats_now()["running"] == 0:
        assert time.monotonic() < deadline
    engine.abort_request("long")
    assert replica.num_in_flight == 0 and not engine.has_unfinished_requests()
    while replica.stats_now()["running"]:
        assert time.monotonic() < deadline
    assert replica.last_stats["kv_blocks_used"] == 0


def test_a_request_the_child_cannot_queue_fails_alone(replica):
    """The front-end checks constraints at admission; one that reaches the child unchecked fails there (a 400
    output for it) and the child serves on."""
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a(b"))
    good = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    replica.add_request(EngineCoreRequest("bad", [1, 2, 3], bad))
    replica.add_request(EngineCoreRequest("good", [1, 2, 3], good))
    outputs: dict = {}
    while replica.has_unfinished_requests():
        for output in replica.step():
            outputs.setdefault(output.request_id, []).append(output)
    (failed,) = outputs["bad"]
    assert failed.finished and failed.error_status == 400 and "regex" in failed.error
    assert sum(len(o.new_token_ids) for o in outputs["good"]) == 4 and outputs["good"][-1].finished


def test_a_replica_that_cannot_start_says_why(tmp_path):
    client = ReplicaClient(3, str(tmp_path / "no-such-model"), OPTIONS, num_threads=1)
    with pytest.raises(ValueError, match="Engine replica 3 failed to start: Model folder .* has no config.json"):
        client.wait_ready(timeout=300)
    assert client.child_process.exitcode is not None


def test_a_killed_replica_fails_the_next_step_at_once(engine, replica):  # last: it kills the module's replica
    died = []
    replica.watch(died.append)
    engine.add_request("k", "Hello", SamplingParams(max_tokens=3000, ignore_eos=True))
    engine.step()  # generating

    def kill():
        time.sleep(0.2)
        os.kill(replica.pid, signal.SIGKILL)

    threading.Thread(target=kill).start()
    started = time.monotonic()
    with pytest.raises(EngineDeadError) as caught:
        while True:
            engine.step()
    assert time.monotonic() - started < 3
    assert "Engine replica 0" in str(caught.value) and "SIGKILL" in str(caught.value)
    assert died and not replica.is_alive
    with pytest.raises(EngineDeadError):
        engine.add_request("after", "Hello", SamplingParams(max_tokens=2))
