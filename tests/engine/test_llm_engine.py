"""The engine's greedy outputs are the same however requests are batched, chunked, cached or
preempted, and the same as Hugging Face generate."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import FuyuForCausalLM as HFFuyu
from transformers import LlavaForConditionalGeneration as HFLlava

from tessera import LLM, SamplingParams
from testkit import random_images

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

QUESTIONS = ["What is this?", "Describe the image.", "How many shapes are there in it?", "Colour?"]
SIZES = [(60, 40), (32, 32), (50, 100), (90, 20), (48, 48)]


def llava_requests(count=16):
    """Mixed requests: 0 to 3 images, different sizes and lengths."""
    requests = []
    for i in range(count):
        num_images = i % 4
        images = random_images([SIZES[(i + k) % len(SIZES)] for k in range(num_images)], seed=i)
        text = "USER: " + "<image>\n" * num_images + QUESTIONS[i % 4] + " ASSISTANT:"
        requests.append({"prompt": text, "multi_modal_data": {"image": images}})
    return requests


def fuyu_requests(count=8):
    return [
        {
            "prompt": QUESTIONS[i % 4],
            "multi_modal_data": {"image": random_images([SIZES[i % 5]], seed=i) if i % 3 else []},
        }
        for i in range(count)
    ]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def make_llm(folder, **options):
    return LLM(str(folder), **{"device": "cpu", "block_size": 4, "kv_cache_memory": "8MiB", **options})


@pytest.fixture(scope="module")
def llava_reference(tiny_llava_dir):
    """Each LLaVA request alone, with default settings."""
    llm = make_llm(tiny_llava_dir)
    return [tokens(llm.generate([r], GREEDY, use_tqdm=False))[0] for r in llava_requests()]


def test_llava_alone_matches_hf_generate(tiny_llava_dir, llava_reference):
    hf_model = HFLlava.from_pretrained(tiny_llava_dir).eval()
    hf_processor = AutoProcessor.from_pretrained(tiny_llava_dir)
    for request, ours in list(zip(llava_requests(), llava_reference))[:4]:
        images = request["multi_modal_data"]["image"] or None
        inputs = hf_processor(text=request["prompt"], images=images, return_tensors="pt")
        with torch.no_grad():
            out = hf_model.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert ours == out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize(
    "options",
    [
        {},  # 16 requests batched together
        {"max_num_batched_tokens": 7},  # chunked prefill: chunks split the 16-token images
        {"enable_prefix_caching": False},
        {"kv_cache_memory": 24 * 1024, "max_num_seqs": 16},  # 24 blocks of 1 KiB: forces preemption
    ],
    ids=["batched", "chunked", "no-prefix-cache", "preemption"],
)
def test_llava_batched_outputs_equal_each_alone(tiny_llava_dir, llava_reference, options):
    llm = make_llm(tiny_llava_dir, **options)
    assert tokens(llm.generate(llava_requests(), GREEDY, use_tqdm=False)) == llava_reference
    if "kv_cache_memory" in options:
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert_all_free(llm)


def test_fuyu_matches_hf_and_batching(tiny_fuyu_dir):
    llm = make_llm(tiny_fuyu_dir, max_num_batched_tokens=10)
    requests = fuyu_requests()
    batched = tokens(llm.generate(requests, GREEDY, use_tqdm=False))
    hf_model = HFFuyu.from_pretrained(tiny_fuyu_dir).eval()
    hf_processor = AutoProcessor.from_pretrained(tiny_fuyu_dir)
    for request, ours in zip(requests[:3], batched):
        images = request["multi_modal_data"]["image"]
        if images:
            inputs = hf_processor(text=request["prompt"], images=images, return_tensors="pt")
        else:  # HF's text-only processing skips the answer token; use our token ids on both sides
            inputs = {
                "input_ids": torch.tensor([llm.engine.processor.apply(request["prompt"], {})["prompt_token_ids"]])
            }
        with torch.no_grad():
            out = hf_model.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=None)
        assert ours == out[0, inputs["input_ids"].shape[1] :].tolist()
    assert_all_free(llm)


def assert_all_free(llm):
    engine = llm.engine
    assert engine.core.block_manager.num_free_blocks == engine.core.num_blocks
    assert all(count == 0 for count in engine.core.block_manager.ref_counts)
    assert engine.core.encoder_cache.num_referenced == 0
    assert not engine.core.scheduler.running and not engine.core.scheduler.waiting


# ---- prefix caching and the encoder cache --------------------------------------------------------


def request_blocks(llm, request):
    """Generate one request, returning the KV blocks it held while running."""
    seen = []
    engine = llm.engine
    engine.add_request("probe", request, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished_requests():
        running = engine.core.scheduler.running
        if running:
            seen = list(engine.core.block_manager.blocks_of(running[0]))
        engine.step()
    return seen


def test_same_tokens_with_different_images_share_no_blocks(tiny_llava_dir):
    llm = make_llm(tiny_llava_dir)
    prompt = "USER: <image>\nWhat colour is the circle in this picture? ASSISTANT:"
    first = request_blocks(llm, {"prompt": prompt, "multi_modal_data": {"image": random_images([(40, 40)], seed=1)}})
    hits_before = llm.engine.core.block_manager.prefix_hits
    second = request_blocks(llm, {"prompt": prompt, "multi_modal_data": {"image": random_images([(40, 40)], seed=2)}})
    # Only the blocks before the image (same tokens, no image in them) may be shared.
    image_start = llm.engine.processor.apply(prompt, {"image": random_images([(40, 40)])})["mm_placeholders"]["image"][
        0
    ].offset
    shared = set(first) & set(second)
    assert shared <= set(first[: image_start // 4])
    assert llm.engine.core.block_manager.prefix_hits - hits_before == len(shared) * 4


def test_repeated_image_and_prompt_reuses_blocks_and_skips_the_encoder(tiny_llava_dir):
    llm = make_llm(tiny_llava_dir)
    request = {
        "prompt": "USER: <image>\nDescribe the image. ASSISTANT:",
        "multi_modal_data": {"image": random_images([(40, 40)])},
    }
    first = request_blocks(llm, request)
    encoded = llm.engine.core.encoder_cache.num_encoded
    second = request_blocks(llm, request)
    num_prompt_tokens = len(
        llm.engine.processor.apply(request["prompt"], request["multi_modal_data"])["prompt_token_ids"]
    )
    full_blocks = (num_prompt_tokens - 1) // 4
    assert second[:full_blocks] == first[:full_blocks]
    assert llm.engine.core.encoder_cache.num_encoded == encoded  # the image was not encoded again


def test_a_configuration_whose_encoder_cannot_hold_one_image_fails_at_start(tiny_llava_dir):
    with pytest.raises(ValueError, match="worst-case prompt.*needs 16 encoder rows"):
        make_llm(tiny_llava_dir, encoder_cache_size=8)


def test_an_item_that_can_never_fit_is_rejected_at_admission(tiny_llava_dir):
    llm = make_llm(tiny_llava_dir, max_num_batched_tokens=32)  # encoder budget and cache: 32 rows
    too_big = {"prompt": "USER: <image> ASSISTANT:", "multi_modal_data": {"image_embeds": torch.randn(1, 40, 32)}}
    with pytest.raises(ValueError, match="needs 40 encoder rows but the encoder budget is 32"):
        llm.generate([llava_requests(2)[1], too_big], GREEDY, use_tqdm=False)
    assert_all_free(llm)  # the valid request queued before it was withdrawn
    assert len(tokens(llm.generate(llava_requests(2), GREEDY, use_tqdm=False))) == 2


# ---- faults: one request's failure is that request's error only ------------------------------------


def _run(engine):
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def test_a_model_failure_fails_the_requests_of_that_step_and_the_engine_keeps_serving(tiny_llava_dir, llava_reference):
    llm = make_llm(tiny_llava_dir)
    engine = llm.engine
    execute, calls = engine.core.runner.execute, []

    def failing_third_step(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return execute(*args)

    engine.core.runner.execute = failing_third_step
    requests = llava_requests(3)
    engine.add_request("a", requests[0], GREEDY)
    engine.add_request("b", requests[1], GREEDY)
    finished = _run(engine)
    for request_id in ("a", "b"):
        output = finished[request_id]
        assert output.error and "RuntimeError" in output.error
        assert [o.finish_reason for o in output.outputs] == ["error"]
        assert len(output.outputs[0].token_ids) < GREEDY.max_tokens  # stopped early
    assert engine.core.block_manager.num_free_blocks == engine.core.num_blocks
    assert not engine.output_processor.requests and not engine.output_processor.sequences
    assert engine.core.encoder_cache.num_referenced == 0
    # the engine goes on: a new request gets what it gets alone
    assert tokens(llm.generate([requests[2]], GREEDY, use_tqdm=False)) == [llava_reference[2]]


def test_a_failure_updating_one_request_fails_only_that_one(tiny_llava_dir, llava_reference, monkeypatch):
    llm = make_llm(tiny_llava_dir)
    engine = llm.engine
    requests = llava_requests(2)
    engine.add_request("ok", requests[0], GREEDY)
    engine.add_request("bad", requests[1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2))

    def broken(token):
        raise UnicodeError("injected")

    monkeypatch.setattr(engine.output_processor.sequences["bad#1"][1].detokenizer, "add", broken)
    finished = _run(engine)
    assert finished["ok"].error is None and tokens([finished["ok"]]) == [llava_reference[0]]
    assert finished["bad"].error and {o.finish_reason for o in finished["bad"].outputs} == {"error"}
    assert engine.core.block_manager.num_free_blocks == engine.core.num_blocks


def test_an_item_the_encoder_cannot_take_fails_only_its_request(tiny_llava_dir, llava_reference):
    """HF's processor takes a 48-pixel crop, but the CLIP tower was built for 32: the encoder cannot take that
    item. Batched with two good requests in one step, only its request fails (a 400: its own inputs)."""
    llm = make_llm(tiny_llava_dir)
    engine = llm.engine
    requests = llava_requests(3)  # 0, 1 and 2 images
    misfit = {**requests[1], "mm_processor_kwargs": {"crop_size": {"height": 48, "width": 48}}}
    engine.add_request("good-1", requests[1], GREEDY)
    engine.add_request("misfit", misfit, GREEDY)
    engine.add_request("good-2", requests[2], GREEDY)
    finished = _run(engine)
    assert tokens([finished["good-1"], finished["good-2"]]) == llava_reference[1:3]
    bad = finished["misfit"]
    assert [o.finish_reason for o in bad.outputs] == ["error"] and bad.error_status == 400
    assert "could not encode" in bad.error and "mm_processor_kwargs" in bad.error
    assert_all_free(llm)


# ---- named items ----------------------------------------------------------------------------------


def test_prefix_caching_keys_a_named_image_on_its_id(tiny_llava_dir):
    """Two different images under one id share cached blocks (the caller promised they are the
    same); unnamed, they share nothing past the text before the image."""
    llm = make_llm(tiny_llava_dir, mm_processor_cache_gb=0)
    first, second = random_images([(60, 40), (32, 32)], seed=21)
    text = "USER: <image>\n" + "Describe the image in detail, please. " * 3 + "ASSISTANT:"

    def reused_tokens(image, uuids):
        blocks = llm.engine.core.block_manager
        before = blocks.prefix_hits
        prompt = {"prompt": text, "multi_modal_data": {"image": image}}
        if uuids is not None:
            prompt["multi_modal_uuids"] = uuids
        output = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        return blocks.prefix_hits - before, output.outputs[0].token_ids

    reused_tokens(first, {"image": ["scene-1"]})
    named_hits, named_tokens = reused_tokens(second, {"image": ["scene-1"]})
    assert named_hits >= len(llm.get_tokenizer().encode(text)) // 4 * 4 - 4  # all but the last block
    _, first_tokens = reused_tokens(first, None)
    assert named_tokens == first_tokens  # computed from the first image's cached state
    unnamed_hits, _ = reused_tokens(second, None)
    assert unnamed_hits < named_hits


def test_the_profile_run_leaves_nothing_behind_and_rebuilds_nothing(tiny_llava_dir):
    engine = make_llm(tiny_llava_dir).engine
    assert engine.core.scheduler.block_manager is engine.core.block_manager
    assert engine.core.scheduler.encoder_cache is engine.core.encoder_cache
    block_manager = engine.core.block_manager
    assert not block_manager.cached_blocks and block_manager.num_free_blocks == engine.core.num_blocks
    assert not engine.core.encoder_cache.entries and engine.core.encoder_cache.num_encoded == 0
    assert not engine.output_processor.requests and not engine.has_unfinished_requests()


def test_a_sequence_the_core_refuses_leaves_nothing_of_its_request(tiny_llava_dir, llava_reference, monkeypatch):
    """The core takes a request's sequences one by one; if it refuses one (e.g. a replica that died), the ones
    it took are ended and the request is forgotten, and the engine serves on."""
    llm = make_llm(tiny_llava_dir)
    engine = llm.engine
    add, taken = engine.core.add_request, []

    def refuse_the_second(request):
        if taken:
            raise RuntimeError("injected refusal")
        taken.append(request.request_id)
        add(request)

    monkeypatch.setattr(engine.core, "add_request", refuse_the_second)
    with pytest.raises(RuntimeError, match="injected refusal"):
        engine.add_request("r", llava_requests(1)[0], SamplingParams(max_tokens=4, n=2))
    assert taken == ["r#0"] and "r" not in engine.output_processor and not engine.has_unfinished_requests()
    assert engine.core.block_manager.num_free_blocks == engine.core.num_blocks
    monkeypatch.undo()
    assert tokens(llm.generate([llava_requests(1)[0]], GREEDY, use_tqdm=False)) == [llava_reference[0]]
