"""LFM2-VL against Hugging Face transformers on a tiny checkpoint (fp32): the processor's token ids and tiles
for images that stay whole and images cut into tiles with a thumbnail, the image features (SigLIP2 NaFlex +
pixel-unshuffle projector), prefill logits, and greedy tokens alone, batched with another prompt, with
prefill chunks cutting an image, under preemption, and from prefix-cache snapshots on later turns."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import Lfm2VlForConditionalGeneration as HFLfm2Vl

from tessera import LLM, SamplingParams
from tessera.config import ModelConfig
from tessera.models.loader import load_model
from tessera.multimodal import MULTIMODAL_REGISTRY
from testkit import random_images
from testkit.generation import greedy_logprobs
from testkit.lfm2_vl import build_tiny_lfm2_vl

TWO_IMAGES = "<|im_start|>user\n<image>What is it? <image> and this?<|im_end|>\n<|im_start|>assistant\n"
ONE_IMAGE = "<|im_start|>user\n<image>Describe it.<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nHello there, how are you?<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def two_images():
    return random_images([(80, 60), (30, 40)], seed=1)  # 2 x 2 tiles + a thumbnail; one tile


@pytest.fixture(scope="module")
def lfm2_vl(tmp_path_factory):
    """(folder, HF model, HF processor, HF's last-token log-probs for TWO_IMAGES, greedy tokens for TWO_IMAGES
    and ONE_IMAGE)."""
    folder = build_tiny_lfm2_vl(tmp_path_factory.mktemp("tiny_lfm2_vl"))
    hf_model = HFLfm2Vl.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    expected = []
    with torch.no_grad():
        for prompt, images in requests_data():
            inputs = processor(text=prompt, images=[images], return_tensors="pt")
            if prompt == TWO_IMAGES:
                logprobs = hf_model(**inputs).logits[0, -1].log_softmax(-1)
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
            expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return folder, hf_model, processor, logprobs, expected


def requests_data():
    return [(TWO_IMAGES, two_images()), (ONE_IMAGE, random_images([(120, 50)], seed=4))]


def requests():
    return [{"prompt": prompt, "multi_modal_data": {"image": images}} for prompt, images in requests_data()]


@pytest.mark.parametrize("sizes", [[(80, 60), (30, 40)], [(120, 50)], [(16, 16)], [(50, 200), (64, 64), (33, 47)]])
def test_processor_matches_hf(lfm2_vl, sizes):
    folder, _, processor, _, _ = lfm2_vl
    images = random_images(sizes, seed=2)
    prompt = " ".join("<image>" for _ in images) + " Compare."
    hf = processor(text=prompt, images=[images], return_tensors="pt")
    ours = MULTIMODAL_REGISTRY.create_processor(folder).apply(prompt, {"image": images})
    assert ours["prompt_token_ids"] == hf["input_ids"][0].tolist()
    items = ours["mm_kwargs"].get_items("image")
    torch.testing.assert_close(torch.cat([item["pixel_values"].data for item in items]), hf["pixel_values"])
    assert torch.cat([item["spatial_shapes"].data for item in items]).tolist() == hf["spatial_shapes"].tolist()
    image_token = processor.image_token_id
    for placeholder in ours["mm_placeholders"]["image"]:  # each image's <image> tokens take its embeddings
        span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
        assert torch.as_tensor(placeholder.is_embed).sum() == span.eq(image_token).sum()


def test_image_features_match_hf(lfm2_vl):
    folder, hf_model, processor, _, _ = lfm2_vl
    model = load_model(ModelConfig(str(folder), device="cpu"))
    images = two_images()
    inputs = processor(text="<image> <image>", images=[images], return_tensors="pt")
    with torch.no_grad():
        hf = hf_model.model.get_image_features(
            pixel_values=inputs["pixel_values"], spatial_shapes=inputs["spatial_shapes"],
            pixel_attention_mask=inputs["pixel_attention_mask"],
        ).pooler_output  # fmt: skip
        ours = model.get_multimodal_embeddings(
            pixel_values=inputs["pixel_values"], spatial_shapes=inputs["spatial_shapes"], num_tiles=[5, 1]
        )
    torch.testing.assert_close(torch.cat(ours), torch.cat(list(hf)), atol=1e-5, rtol=0)


def test_prefill_logits_match_hf(lfm2_vl):
    folder, _, _, expected, _ = lfm2_vl
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB")
    ((_, logprobs),) = greedy_logprobs(llm, requests()[:1], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "preemption"])
def test_greedy_tokens_match_hf_alone_and_batched(lfm2_vl, options):
    folder, _, _, _, expected = lfm2_vl
    kwargs = {
        "default": {},
        "chunked-prefill": {"max_num_batched_tokens": 7},  # the images' 16-token tiles cut between chunks
        # 2 attention layers x K and V x 2 heads x 8 dims x 4 bytes = 256 bytes a token; the conv states of 4
        # sequences (2 layers x 32 channels x 2 x 4 bytes = 512 bytes each) and 40 blocks of 4 tokens: the
        # two-image prompt (127 tokens, 32 blocks) and the text one (32 tokens, 8 blocks) fill them, and the
        # text one needs a 41st block at its first generated token
        "preemption": {"kv_cache_memory": 40 * 4 * 256 + 4 * 512, "max_num_seqs": 4, "enable_prefix_caching": False},
    }[options]
    llm = LLM(str(folder), device="cpu", block_size=4, **{"kv_cache_memory": "4MiB", **kwargs})
    assert [tokens(llm, [r])[0] for r in requests()] == expected
    two, one = requests()
    assert tokens(llm, [two, TEXT, one])[::2] == expected  # batched with a text prompt
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_later_turns_about_the_image_start_from_snapshots(lfm2_vl):
    """Turns that repeat the last prompt and its answer: each hits the prefix cache (the engine's counters)
    and still answers as HF does for the whole prompt."""
    folder, hf_model, processor, _, _ = lfm2_vl
    image = random_images([(80, 60)], seed=5)
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB")
    blocks, prompt, hits = llm.engine.core.block_manager, ONE_IMAGE, []
    for question in ("And the colours?", "Thanks."):
        inputs = processor(text=prompt, images=[image], return_tensors="pt")
        with torch.no_grad():
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
        (got,) = tokens(llm, [{"prompt": prompt, "multi_modal_data": {"image": image}}])
        assert got == out[0, inputs["input_ids"].shape[1] :].tolist()
        hits.append(blocks.prefix_hits)
        answer = processor.tokenizer.decode(got)
        prompt += answer + f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    assert (
        tokens(llm, [{"prompt": prompt, "multi_modal_data": {"image": image}}])[0]
        == out[0, inputs["input_ids"].shape[1] :].tolist()
    )
    hits.append(blocks.prefix_hits)
    assert hits[0] == 0 < hits[1] < hits[2]
