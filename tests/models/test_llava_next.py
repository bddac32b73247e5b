"""LLaVA-NeXT against Hugging Face transformers on a tiny checkpoint (fp32): the processor's outputs and
token counts over image sizes that pick every grid, the image features (anyres tiles, unpadding,
newlines), prefill logits, and greedy tokens alone, batched, with chunked prefill (chunks ending inside
images), prefix caching and preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import LlavaNextForConditionalGeneration as HFLlavaNext

from tessera import LLM, SamplingParams
from tessera.config import ModelConfig
from tessera.models.loader import load_model
from tessera.multimodal import MULTIMODAL_REGISTRY
from testkit import random_images
from testkit.generation import greedy_logprobs
from testkit.llava_next import build_tiny_llava_next

PROMPTS = [  # (prompt, image sizes (width, height))
    ("USER: What is in the picture? ASSISTANT:", []),
    ("USER: <image>\nWhat colour is the circle? ASSISTANT:", [(60, 40)]),
    ("USER: <image>\n<image> and <image>\nCompare them. ASSISTANT:", [(200, 30), (7, 9), (100, 100)]),
]
SIZES = [  # tiny, square (one tile), wide, tall, larger than the largest grid (96 px), odd
    [(7, 9)], [(32, 32)], [(200, 30)], [(30, 200)], [(300, 250)], [(64, 33)], [(60, 40), (33, 70), (100, 100)],
]  # fmt: skip
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
BLOCK = 4
LIMITS = {"image": 3}  # the most a prompt here has: a cheaper profile run


@pytest.fixture(scope="module")
def llava_next(tmp_path_factory):
    """(folder, HF model, HF processor, HF's inputs and greedy tokens per PROMPTS entry)."""
    folder = build_tiny_llava_next(tmp_path_factory.mktemp("tiny_llava_next"))
    hf_model = HFLlavaNext.from_pretrained(folder, attn_implementation="eager").eval()
    hf_processor = AutoProcessor.from_pretrained(folder)
    inputs, expected = [], []
    for i, (prompt, sizes) in enumerate(PROMPTS):
        inputs.append(hf_processor(text=prompt, images=random_images(sizes, seed=i) or None, return_tensors="pt"))
        with torch.no_grad():
            out = hf_model.generate(**inputs[-1], max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
        expected.append(out[0, inputs[-1]["input_ids"].shape[1] :].tolist())
    return folder, hf_model, hf_processor, inputs, expected


def request(i: int):
    prompt, sizes = PROMPTS[i]
    return {"prompt": prompt, "multi_modal_data": {"image": random_images(sizes, seed=i)}} if sizes else prompt


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def hf_num_tokens(hf_processor, size) -> int:
    """HF's placeholder count for an image of `size` alone."""
    ids = hf_processor(text="<image>", images=random_images([size]), return_tensors="pt")["input_ids"]
    return int(ids.eq(hf_processor.image_token_id).sum())


@pytest.mark.parametrize("cache_gb", [0, 1])
@pytest.mark.parametrize("sizes", SIZES)
def test_processor_matches_hf(llava_next, sizes, cache_gb):
    folder, _, hf_processor, _, _ = llava_next
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    prompt = "USER: " + " and ".join(["<image>"] * len(sizes)) + " What is it? ASSISTANT:"
    images = random_images(sizes)
    hf = hf_processor(text=prompt, images=images, return_tensors="pt")
    for _ in range(2):  # the second call hits the processor cache when there is one
        out = processor.apply(prompt, {"image": images})
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        items = out["mm_kwargs"].get_items("image")
        assert torch.stack([item["image_sizes"].data for item in items]).tolist() == hf["image_sizes"].tolist()
        for item, hf_pixels in zip(items, hf["pixel_values"]):
            pixels = item["pixel_values"].data  # the image's own tiles; HF pads to the call's most
            torch.testing.assert_close(pixels, hf_pixels[: len(pixels)], atol=0, rtol=0)
            assert not hf_pixels[len(pixels) :].any()
        for placeholder, size in zip(out["mm_placeholders"]["image"], sizes):
            span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
            assert span.eq(hf_processor.image_token_id).all()
            assert placeholder.length == hf_num_tokens(hf_processor, size)
    assert sum(p.length for p in out["mm_placeholders"]["image"]) == int(
        hf["input_ids"].eq(hf_processor.image_token_id).sum()
    )


def test_num_image_tokens_match_hf_for_every_grid(llava_next):
    folder, _, hf_processor, _, _ = llava_next
    info = MULTIMODAL_REGISTRY.create_processor(folder).info
    sizes = [size for group in SIZES for size in group] + [(w, h) for h, w in info.get_grid_pinpoints()]
    grids = set()
    for width, height in sizes:
        assert info.get_num_image_tokens(image_width=width, image_height=height) == hf_num_tokens(
            hf_processor, (width, height)
        ), (width, height)
        pixels = hf_processor.image_processor(images=random_images([(width, height)]), return_tensors="pt")
        grids.add(pixels["pixel_values"].shape[1])
    assert len(grids) >= 3  # the table picks several grids (tile counts)
    width, height = info.get_image_size_with_most_features()
    assert info.get_max_image_tokens() == hf_num_tokens(hf_processor, (width, height))
    assert all(info.get_max_image_tokens() >= hf_num_tokens(hf_processor, size) for size in sizes)


def test_image_features_match_hf(llava_next):
    folder, hf_model, hf_processor, _, _ = llava_next
    model = load_model(ModelConfig(str(folder), device="cpu"))
    images = random_images([(200, 30), (7, 9), (30, 200), (300, 250)], seed=5)
    inputs = hf_processor.image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        ours = model.get_multimodal_embeddings(**inputs)  # HF's padded [N, max_tiles, ...] layout
        expected = hf_model.model.get_image_features(**inputs).pooler_output
    assert [e.shape for e in ours] == [e.shape for e in expected]
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_prefill_logits_match_hf(llava_next):
    folder, hf_model, _, inputs, _ = llava_next
    options = {"kv_cache_memory": "4MiB", "enable_prefix_caching": False, "limit_mm_per_prompt": LIMITS}
    llm = LLM(str(folder), device="cpu", block_size=BLOCK, **options)
    for i in range(len(PROMPTS)):
        with torch.no_grad():
            expected = hf_model(**inputs[i]).logits[0, -1].log_softmax(-1)
        ((_, logprobs),) = greedy_logprobs(llm, [request(i)], 1, expected.shape[0])
        torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


def preemption_cache_bytes(hf_model, inputs) -> int:
    """KV bytes for exactly the blocks of the longest prompt (2) and the text one (0): both start together,
    then the longest needs another block within its first 4 output tokens, when none is free."""
    text = hf_model.config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    bytes_per_token = text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * 4  # K and V, fp32
    lengths = [x["input_ids"].shape[1] for x in inputs]
    blocks = -(-lengths[2] // BLOCK) + -(-lengths[0] // BLOCK)
    assert -(-(lengths[2] + MAX_TOKENS) // BLOCK) <= blocks  # the longest fits alone
    return blocks * BLOCK * bytes_per_token


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "prefix-caching", "preemption"])
def test_greedy_tokens_match_hf_alone_and_batched(llava_next, options):
    folder, hf_model, hf_processor, inputs, expected = llava_next
    chunk = 16
    kwargs = {
        "default": {"enable_prefix_caching": False},
        "chunked-prefill": {"max_num_batched_tokens": chunk, "enable_prefix_caching": False},
        "prefix-caching": {},
        "preemption": {"kv_cache_memory": preemption_cache_bytes(hf_model, inputs), "enable_prefix_caching": False},
    }[options]
    if options == "chunked-prefill":  # some chunk ends inside an image
        ids = inputs[2]["input_ids"][0].eq(hf_processor.image_token_id).tolist()
        assert any(ids[k - 1] and ids[k] for k in range(chunk, len(ids), chunk))
    llm = LLM(
        str(folder), device="cpu", block_size=BLOCK, limit_mm_per_prompt=LIMITS, **{"kv_cache_memory": "4MiB", **kwargs}
    )
    assert [tokens(llm, [request(i)])[0] for i in range(len(PROMPTS))] == expected
    hits = llm.engine.core.block_manager.prefix_hits
    assert tokens(llm, [request(2), request(0), request(1)]) == [expected[2], expected[0], expected[1]]
    if options == "prefix-caching":
        assert llm.engine.core.block_manager.prefix_hits > hits
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_mistral_backbone_matches_hf(tmp_path):
    """llava-v1.6-mistral's layout: the same tower and anyres, a Mistral decoder from the text-model registry."""
    folder = build_tiny_llava_next(tmp_path / "mistral", text_model="mistral")
    hf_model = HFLlavaNext.from_pretrained(folder, attn_implementation="eager").eval()
    prompt, sizes = PROMPTS[2]
    images = random_images(sizes, seed=2)
    with torch.no_grad():
        expected = hf_model(**AutoProcessor.from_pretrained(folder)(text=prompt, images=images, return_tensors="pt"))
    expected = expected.logits[0, -1].log_softmax(-1)
    llm = LLM(str(folder), device="cpu", block_size=BLOCK, kv_cache_memory="4MiB", limit_mm_per_prompt=LIMITS)
    assert type(llm.engine.core.model.language_model).__name__ == "MistralForCausalLM"
    ((_, logprobs),) = greedy_logprobs(llm, [request(2)], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


def test_registry_resolves_llava_next(llava_next):
    from tessera.models.registry import ModelRegistry

    folder = llava_next[0]
    model = load_model(ModelConfig(str(folder), device="cpu"))
    cls, arch = ModelRegistry.resolve_model_cls(["LlavaNextForConditionalGeneration"])
    assert isinstance(model, cls) and arch == "LlavaNextForConditionalGeneration"
    assert type(model.language_model).__name__ == "LlamaForCausalLM"
