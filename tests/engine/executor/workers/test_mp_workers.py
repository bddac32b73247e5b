"""Tensor parallelism over local worker processes (gloo, CPU, fp32): two ranks give every step's logits
within 1e-4 of one rank and the same greedy tokens, on the tiny LLaVA (images, chunked prefill inside an
image) and on tiny text backbones (Llama, Qwen3 with q/k norms and windows, Gemma 3 with its scaled
embedding and soft-capping; preemption), and on routed experts (Qwen3-MoE, Qwen3-VL-MoE with its experts stored
transposed). A killed worker fails the engine loudly and at once."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tessera import LLM, SamplingParams
from tessera.errors import WorkerDiedError
from testkit import build_tiny_text_model, random_images
from testkit.distributed import assert_same_logits, generate_recording, recorded_logits
from testkit.generation import kv_bytes_per_token

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TEXT_PROMPTS = ["How many squares are there?", "The circle is red and the square is blue.", "A b c d e f g h"]
TEXT_MODELS = {  # Llama: the tiny LLaVA's and the preemption test's language model
    "qwen3-window": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=16, use_sliding_window=True, sliding_window=6,
                                                         max_window_layers=0)),
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                                         layer_types=["sliding_attention", "full_attention"],
                                                         final_logit_softcapping=30.0)),
}  # fmt: skip


def llava_prompts():
    images = random_images([(40, 30), (32, 48)], seed=1)
    return [
        {"prompt": "USER: <image>\nWhat is this? ASSISTANT:", "multi_modal_data": {"image": images[0]}},
        "USER: Hello there, how are you? ASSISTANT:",
        {"prompt": "USER: <image>\nAnd this <image> one? ASSISTANT:", "multi_modal_data": {"image": images}},
    ]


def worker_monitors() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "tessera-worker-monitor" and t.is_alive()}


def compare(folder, prompts, **options):
    """Generate with one rank and with two; the same tokens and logits (within 1e-4) at every step."""
    results = {}
    for size in (1, 2):
        monitors = worker_monitors()
        llm = LLM(str(folder), dtype="float32", tensor_parallel_size=size, **options)
        try:
            results[size] = generate_recording(llm, prompts, GREEDY) + (llm.engine.core.scheduler.num_preemptions,)
        finally:
            llm.shutdown()
        # shutdown waits for the death monitor: left running, it could free the process group at interpreter exit
        assert worker_monitors() <= monitors
    (tokens_1, logits_1, preempted_1), (tokens_2, logits_2, preempted_2) = results[1], results[2]
    assert tokens_2 == tokens_1
    assert_same_logits(logits_1, logits_2)
    return preempted_1, preempted_2


@pytest.mark.parametrize("case", ["default", "chunked-prefill"])
def test_two_ranks_match_one_on_the_tiny_llava(tiny_llava_dir, case):
    options = {"kv_cache_memory": "4MiB"}
    if case == "chunked-prefill":  # 16-token images: a chunk boundary falls inside each
        options["max_num_batched_tokens"] = 10
    compare(tiny_llava_dir, llava_prompts(), **options)


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_two_ranks_match_one_on_text_backbones(tmp_path, name):
    hf_cls, config_cls, overrides = TEXT_MODELS[name]
    folder = build_tiny_text_model(tmp_path, hf_cls, config_cls, **overrides)
    compare(folder, TEXT_PROMPTS, kv_cache_memory="4MiB", block_size=4)


def test_two_ranks_match_one_on_routed_experts(tmp_path):
    """Qwen3-MoE (8 experts, top 2, every layer routed): each rank runs its half of every expert's intermediate
    channels, the halves summed once per layer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from testkit.checkpoints import save_widened_random_weights
    from testkit.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("llava")
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    save_widened_random_weights(Qwen3MoeForCausalLM, config, tmp_path, seed=0)
    tokenizer.save_pretrained(tmp_path)
    compare(tmp_path, TEXT_PROMPTS, kv_cache_memory="4MiB", block_size=4)


def test_two_ranks_match_one_on_qwen3_vl_moe_as_released(tmp_path):
    """Qwen3-VL-MoE with its experts stored transposed as in the released files: each rank takes its slice after
    the tensor is laid out as transformers holds it."""
    from testkit.qwen_vl import build_tiny_qwen3_vl_moe

    folder = build_tiny_qwen3_vl_moe(tmp_path, released_layout=True)
    image = (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n"
    )
    prompts = [{"prompt": image, "multi_modal_data": {"image": random_images([(50, 100)], seed=1)}}, "Hello there"]
    compare(folder, prompts, kv_cache_memory="4MiB", block_size=4)


@pytest.mark.parametrize("kind", ["e", "moe"])
def test_two_ranks_match_one_on_gemma4(tmp_path, kind):
    """Gemma 4's decoder (testkit/gemma4.py; the MoE shape with 2 KV heads on its full layers so they split): each
    rank its heads of every layer's own geometry, the KV-shared layers reading their rank's store layer, the
    per-layer embeddings whole on each rank, the experts' channels split."""
    from transformers import Gemma4ForCausalLM

    from testkit.checkpoints import save_widened_random_weights
    from testkit.gemma4 import gemma4_config, gemma4_tokenizer

    tokenizer = gemma4_tokenizer()
    overrides = {"num_global_key_value_heads": 2} if kind == "moe" else {}
    save_widened_random_weights(Gemma4ForCausalLM, gemma4_config(tokenizer, kind, **overrides).text_config, tmp_path, 0)
    tokenizer.save_pretrained(tmp_path)
    compare(tmp_path, TEXT_PROMPTS, kv_cache_memory="4MiB", block_size=4)


def test_two_ranks_match_one_under_preemption(tmp_path):
    folder = build_tiny_text_model(tmp_path, LlamaForCausalLM, LlamaConfig)
    text_config = LlamaConfig.from_pretrained(folder)
    # per rank: the blocks the prompts fill when they start together (each rank holds half the kv heads)
    memory = lambda size: 3 * 4 * 4 * kv_bytes_per_token(text_config) // size  # noqa: E731
    tokens, logits, preempted = {}, {}, {}
    for size in (1, 2):
        llm = LLM(str(folder), dtype="float32", tensor_parallel_size=size, kv_cache_memory=memory(size), block_size=4,
                  enable_prefix_caching=False)  # fmt: skip
        try:
            tokens[size], logits[size] = generate_recording(llm, TEXT_PROMPTS, GREEDY)
            preempted[size] = llm.engine.core.scheduler.num_preemptions
        finally:
            llm.shutdown()
    assert preempted[1] > 0 and preempted[2] == preempted[1]
    assert tokens[2] == tokens[1]
    assert_same_logits(logits[1], logits[2])


def test_a_model_that_cannot_split_is_refused_clearly(tiny_fuyu_dir):
    with pytest.raises(ValueError, match="does not support tensor parallelism.*tensor_parallel_size=1"):
        LLM(str(tiny_fuyu_dir), dtype="float32", tensor_parallel_size=2, kv_cache_memory="4MiB")


def test_heads_that_do_not_divide_are_refused_clearly(tmp_path):
    folder = build_tiny_text_model(tmp_path, LlamaForCausalLM, LlamaConfig, num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(1\) is not divisible by tensor_parallel_size \(2\)"):
        LLM(str(folder), dtype="float32", tensor_parallel_size=2, kv_cache_memory="4MiB")


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_a_killed_worker_fails_requests_and_turns_the_server_unhealthy(tiny_llava_dir):
    from tessera.engine.async_engine import AsyncEngine
    from tessera.engine.llm_engine import LLMEngine
    from tessera.entrypoints.openai.api_server import ServerThread, build_app

    engine = AsyncEngine(LLMEngine.from_options(str(tiny_llava_dir), tensor_parallel_size=2, kv_cache_memory="4MiB"))
    worker = engine.engine.core.workers.processes[0]
    try:
        with ServerThread(build_app(engine, model_name="tiny")) as url:
            assert httpx.get(url + "/health").json() == {"status": "ok"}
            body = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
                lines = response.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))  # generating
                killed_at = time.monotonic()
                os.kill(worker.pid, signal.SIGKILL)
                rest = "\n".join(lines)
            assert "rank 1" in rest and "SIGKILL" in rest, rest[-500:]
            assert wait_for(lambda: httpx.get(url + "/health").status_code == 503, 5)
            assert time.monotonic() - killed_at < 5
    finally:
        engine.shutdown()


def test_a_killed_worker_makes_the_offline_engine_raise(tiny_llava_dir):
    llm = LLM(str(tiny_llava_dir), tensor_parallel_size=2, kv_cache_memory="4MiB")
    try:
        worker = llm.engine.core.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=5)
        with pytest.raises(WorkerDiedError, match=rf"rank 1 \(pid {worker.pid}\) was killed by SIGKILL"):
            llm.generate("hello", GREEDY, use_tqdm=False)
        with pytest.raises(WorkerDiedError):
            llm.engine.check_health()
    finally:
        llm.shutdown()


VLM_BUILDERS = {  # the vision side runs on rank 0 only: what differs under TP is the language model and its inputs
    "qwen2_5_vl": "testkit.qwen_vl:build_tiny_qwen2_5_vl",  # M-RoPE positions
    "qwen3_vl": "testkit.qwen_vl:build_tiny_qwen3_vl",  # DeepStack features beside the embeddings
    "gemma3": "testkit.gemma3:build_tiny_gemma3",  # bidirectional image spans, scaled embedding
    "llava_onevision": "testkit.llava_next:build_tiny_llava_onevision",  # Qwen2 (biased q/k/v), as InternVL's
}
"""SmolVLM's and Mistral 3's language models (Llama, Mistral) split as the tiny LLaVA's does; InternVL's (Qwen2) as
LLaVA-OneVision's."""


@pytest.mark.parametrize("name", VLM_BUILDERS)
def test_two_ranks_match_one_on_other_vlms(tmp_path, name):
    import importlib

    module, function = VLM_BUILDERS[name].split(":")
    folder = getattr(importlib.import_module(module), function)(tmp_path)
    image = random_images([(64, 48)], seed=3)[0]
    chats = [
        [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "What?"}]}],
        [{"role": "user", "content": "Hello there"}],
    ]
    results = {}
    for size in (1, 2):
        llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", tensor_parallel_size=size)
        try:
            with recorded_logits() as steps:
                outputs = llm.chat(chats, GREEDY, use_tqdm=False)
            results[size] = [list(o.outputs[0].token_ids) for o in outputs], steps
        finally:
            llm.shutdown()
    assert results[2][0] == results[1][0]
    assert_same_logits(results[1][1], results[2][1])
