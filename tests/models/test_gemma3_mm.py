"""Gemma 3 VLM against Hugging Face transformers on a tiny checkpoint (fp32): the processor's outputs
(several image sizes, two images per prompt, pan-and-scan on and off), prefill logits, and greedy tokens
alone, batched, with chunked prefill (a chunk boundary inside an image: the scheduler keeps it whole),
prefix caching and preemption; the prompts are longer than the sliding window (6)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import Gemma3ForConditionalGeneration as HFGemma3

from tessera import LLM, SamplingParams
from tessera.multimodal import MULTIMODAL_REGISTRY
from testkit import random_images
from testkit.gemma3 import BOI, EOI, MM_TOKENS_PER_IMAGE, PAN_AND_SCAN, SLIDING_WINDOW, build_tiny_gemma3
from testkit.generation import (
    ENGINE_CASES,
    assert_chunk_boundary_inside_an_item,
    assert_engine_case_happened,
    engine_case_options,
    greedy_logprobs,
)

PAS = dict(do_pan_and_scan=True, **PAN_AND_SCAN)
TEXT = "What is in the image? Describe the image."
PROMPTS = [  # (prompt, image sizes (width, height))
    ("Describe the image.<start_of_image>What colour is the circle?", [(40, 30)]),
    ("<start_of_image> and\n<start_of_image>Compare them. What is in the image?", [(100, 30), (30, 70)]),
]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CHUNK = 8


def request(i: int):
    prompt, sizes = PROMPTS[i]
    return {"prompt": prompt, "multi_modal_data": {"image": random_images(sizes, seed=i)}}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(folder, HF model, HF processor, {pas: (HF inputs, HF greedy tokens) per PROMPTS entry})."""
    folder = build_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3"))
    hf_model = HFGemma3.from_pretrained(folder, attn_implementation="eager").eval()
    hf_processor = AutoProcessor.from_pretrained(folder)
    expected = {}
    for pas in (False, True):
        runs = []
        for i, (prompt, sizes) in enumerate(PROMPTS):
            inputs = hf_processor(
                text=prompt, images=random_images(sizes, seed=i), return_tensors="pt", **(PAS if pas else {})
            )
            with torch.no_grad():
                out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
            runs.append((inputs, out[0, inputs["input_ids"].shape[1] :].tolist()))
        expected[pas] = runs
    return folder, hf_model, hf_processor, expected


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("cache_gb", [0, 1])
@pytest.mark.parametrize("pas", [False, True], ids=["plain", "pan-and-scan"])
@pytest.mark.parametrize("sizes", [[(7, 9)], [(32, 32)], [(200, 30)], [(60, 40), (30, 200)], [(40, 30), (16, 16)]])
def test_processor_matches_hf(gemma3, sizes, pas, cache_gb):
    folder, _, hf_processor, _ = gemma3
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    prompt = "Look:" + " and\n".join([BOI] * len(sizes)) + "What is it?"
    images = random_images(sizes)
    kwargs = PAS if pas else {}
    hf = hf_processor(text=prompt, images=images, return_tensors="pt", **kwargs)
    soft = hf_processor.tokenizer.image_token_id
    boi_id, eoi_id = hf_processor.tokenizer.convert_tokens_to_ids([BOI, EOI])
    for _ in range(2):  # the second call hits the processor cache when there is one
        out = processor.apply(prompt, {"image": images}, kwargs)
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        items = out["mm_kwargs"].get_items("image")
        torch.testing.assert_close(torch.cat([i["pixel_values"].data for i in items]), hf["pixel_values"])
        placeholders = out["mm_placeholders"]["image"]
        assert len(placeholders) == len(images)
        for placeholder, image in zip(placeholders, images):
            span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
            assert torch.equal(torch.as_tensor(placeholder.is_embed), span.eq(soft))
            assert span[0] == boi_id and span[-1] == eoi_id
            count = processor.info.get_num_image_tokens(
                image_width=image.size[0], image_height=image.size[1], mm_kwargs=kwargs
            )
            assert count == int(span.eq(soft).sum())
        assert sum(int(torch.as_tensor(p.is_embed).sum()) for p in placeholders) == int(hf["input_ids"].eq(soft).sum())
    if pas and sizes == [(200, 30)]:  # 3 crops: the image and its crops, each of MM_TOKENS_PER_IMAGE tokens
        assert hf["pixel_values"].shape[0] == 4
        assert int(hf["input_ids"].eq(soft).sum()) == 4 * MM_TOKENS_PER_IMAGE


@pytest.mark.parametrize("pas", [False, True], ids=["plain", "pan-and-scan"])
def test_prefill_logits_match_hf(gemma3, pas):
    folder, hf_model, _, expected = gemma3
    inputs, _ = expected[pas][1]
    assert inputs["input_ids"].shape[1] > SLIDING_WINDOW
    with torch.no_grad():
        want = hf_model(**inputs).logits[0, -1].log_softmax(-1)
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB", enable_prefix_caching=False,
              limit_mm_per_prompt={"image": 2}, mm_processor_kwargs=PAS if pas else {})  # fmt: skip
    ((_, logprobs),) = greedy_logprobs(llm, [request(1)], 1, want.shape[0])
    torch.testing.assert_close(logprobs[0], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", [*ENGINE_CASES, "pan-and-scan"])
def test_greedy_tokens_match_hf_alone_and_batched(gemma3, options):
    folder, hf_model, hf_processor, expected = gemma3
    pas = options == "pan-and-scan"
    runs = expected[pas]
    want = [tokens_ for _, tokens_ in runs]
    lens = [inputs["input_ids"].shape[1] for inputs, _ in runs]
    lens.append(len(hf_processor.tokenizer.encode(TEXT)))  # the image prompts and the text one start together
    kwargs = (
        {"mm_processor_kwargs": PAS}
        if pas
        else engine_case_options(options, text_config=hf_model.config.text_config, prompt_lens=lens, chunk=CHUNK)
    )
    llm = LLM(str(folder), device="cpu", block_size=4,
              **{"kv_cache_memory": "4MiB", "limit_mm_per_prompt": {"image": 2}, **kwargs})  # fmt: skip
    if options == "chunked-prefill":  # a chunk boundary falls inside an image: the scheduler keeps it whole
        assert_chunk_boundary_inside_an_item(llm, request(0), "image", CHUNK)
        assert llm.engine.core.scheduler_config.disable_chunked_mm_input
    assert [tokens(llm, [request(i)])[0] for i in range(len(PROMPTS))] == want
    hits = llm.engine.core.block_manager.prefix_hits
    assert tokens(llm, [request(0), TEXT, request(1)])[::2] == want  # batched
    assert_engine_case_happened(llm, options, hits)


def test_image_tokens_attend_both_ways(gemma3):
    """The same weights attending causally among an image's tokens answer otherwise: the bidirectional
    spans are in use (and HF's answer, matched above, needs them)."""
    folder, _, _, expected = gemma3
    inputs, want = expected[False][1]
    hf_model = gemma3[1]
    with torch.no_grad():  # HF without token_type_ids: causal everywhere
        causal = dict(inputs)
        causal.pop("token_type_ids")
        out = hf_model.generate(**causal, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
        logits = hf_model(**causal).logits[0, -1]
        bidir = hf_model(**inputs).logits[0, -1]
    assert not torch.allclose(logits, bidir, atol=1e-4)
    assert out.shape[1] > 0
