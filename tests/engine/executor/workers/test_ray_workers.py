"""Tensor parallelism with `distributed_executor_backend="ray"`: rank 1 is a Ray actor of a local Ray
instance the test starts. Two ranks match one (every step's logits within 1e-4, the same greedy tokens)
on the tiny LLaVA and a tiny Llama, and a killed actor fails the engine loudly."""

from __future__ import annotations

import os
import signal

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from tessera import LLM, SamplingParams
from tessera.errors import WorkerDiedError
from testkit import build_tiny_text_model, random_images
from testkit.distributed import assert_same_logits, generate_recording

ray = pytest.importorskip("ray", reason="the ray extra is not installed (make test installs it)")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_workers_match_one_rank(tiny_llava_dir, tmp_path):
    images = random_images([(40, 30)], seed=2)
    cases = [
        (tiny_llava_dir, [{"prompt": "USER: <image>\nWhat is it? ASSISTANT:", "multi_modal_data": {"image": images}},
                          "USER: Hi there ASSISTANT:"]),
        (build_tiny_text_model(tmp_path, LlamaForCausalLM, LlamaConfig), ["The circle is red", "A b c d e"]),
    ]  # fmt: skip
    for folder, prompts in cases:
        single = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB")
        tokens_1, logits_1 = generate_recording(single, prompts, GREEDY)
        llm = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", tensor_parallel_size=2,
                  distributed_executor_backend="ray")  # fmt: skip
        try:
            assert type(llm.engine.core.workers).__name__ == "RayWorkers"
            tokens_2, logits_2 = generate_recording(llm, prompts, GREEDY)
        finally:
            llm.shutdown()
        assert tokens_2 == tokens_1
        assert_same_logits(logits_1, logits_2)


def test_a_killed_ray_worker_makes_the_engine_raise(tiny_llava_dir):
    llm = LLM(str(tiny_llava_dir), kv_cache_memory="4MiB", tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        (pid,) = llm.engine.core.workers.pids()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=r"rank 1 \(Ray actor\) failed"):
            llm.generate("hello", GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
