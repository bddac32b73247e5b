"""Idefics3 against Hugging Face transformers on a tiny checkpoint (fp32): the processor's outputs (tiles,
row/column markers) over many image sizes, token counts per image size, the vision tower and connector,
prefill logits, and greedy tokens alone, batched, with chunked prefill (chunk boundaries on markers
inside an image's placeholder), prefix caching and preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import Idefics3ForConditionalGeneration as HFIdefics3

from tessera import LLM, SamplingParams
from tessera.config import ModelConfig
from tessera.models.loader import load_model
from tessera.multimodal import MULTIMODAL_REGISTRY
from testkit import random_images
from testkit.generation import greedy_logprobs
from testkit.idefics3 import build_tiny_idefics3

TEXT = "User: What is in the image?<end_of_utterance>\nAssistant:"
ONE_IMAGE = "User:<image>What colour is the circle?<end_of_utterance>\nAssistant:"
TWO_IMAGES = "User:<image> and <image>Compare them.<end_of_utterance>\nAssistant:"
ONE_SIZES, TWO_SIZES = [(50, 100)], [(200, 30), (60, 40)]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SIZES = [  # (width, height): tiny, square, one tile, very wide, very tall, larger than the resize, odd
    [(7, 9)], [(32, 32)], [(96, 96)], [(200, 30)], [(30, 200)], [(300, 250)], [(97, 33)],
    [(60, 40), (33, 70), (100, 100)],
]  # fmt: skip


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    """(folder, HF model, HF processor, HF's inputs for TWO_IMAGES, its last-token log-probs, HF's
    greedy tokens for TWO_IMAGES and ONE_IMAGE)."""
    folder = build_tiny_idefics3(tmp_path_factory.mktemp("tiny_idefics3"))
    hf_model = HFIdefics3.from_pretrained(folder, attn_implementation="eager").eval()
    hf_processor = AutoProcessor.from_pretrained(folder)
    two = hf_processor(text=TWO_IMAGES, images=random_images(TWO_SIZES, seed=2), return_tensors="pt")
    one = hf_processor(text=ONE_IMAGE, images=random_images(ONE_SIZES, seed=1), return_tensors="pt")
    with torch.no_grad():
        logprobs = hf_model(**two).logits[0, -1].log_softmax(-1)
        expected = []
        for inputs in (two, one):
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
            expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return folder, hf_model, hf_processor, two, logprobs, expected


def requests():
    return [
        {"prompt": TWO_IMAGES, "multi_modal_data": {"image": random_images(TWO_SIZES, seed=2)}},
        {"prompt": ONE_IMAGE, "multi_modal_data": {"image": random_images(ONE_SIZES, seed=1)}},
    ]


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("cache_gb", [0, 1])
@pytest.mark.parametrize("sizes", SIZES, ids=lambda sizes: "+".join(f"{w}x{h}" for w, h in sizes))
def test_processor_matches_hf(idefics3, sizes, cache_gb):
    folder, _, hf_processor, _, _, _ = idefics3
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    prompt = "User:" + " and ".join(["<image>"] * len(sizes)) + "What is it?<end_of_utterance>\n"
    images = random_images(sizes)
    hf = hf_processor(text=prompt, images=images, return_tensors="pt")
    image_token_id = hf_processor.image_token_id
    for _ in range(2):  # the second call hits the processor cache when there is one
        out = processor.apply(prompt, {"image": images})
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        items = out["mm_kwargs"].get_items("image")
        assert torch.equal(torch.cat([item["pixel_values"].data for item in items]), hf["pixel_values"][0])
        masks = torch.cat([item["pixel_attention_mask"].data for item in items])
        assert torch.equal(masks, hf["pixel_attention_mask"][0])
        placeholders = out["mm_placeholders"]["image"]
        assert len(placeholders) == len(sizes)
        for placeholder, (width, height) in zip(placeholders, sizes):
            span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
            is_embed = torch.as_tensor(placeholder.is_embed)
            assert torch.equal(is_embed, span.eq(image_token_id))  # only the <image> tokens, all of them
            assert span[0] == span[-1] == hf_processor.fake_image_token_id
            count = processor.info.get_num_image_tokens(image_width=width, image_height=height)
            assert count == int(span.eq(image_token_id).sum())
    # every <image> token of HF's prompt belongs to a placeholder
    embeds = sum(int(torch.as_tensor(p.is_embed).sum()) for p in placeholders)
    assert embeds == int(hf["input_ids"].eq(image_token_id).sum())


def test_token_counts_match_hf_over_many_sizes(idefics3):
    """get_num_image_tokens is the number of <image> tokens HF's processor gives each size."""
    folder, _, hf_processor, _, _, _ = idefics3
    info = MULTIMODAL_REGISTRY.create_processor(folder).info
    for width, height in [(1, 1), (5, 300), (95, 97), (64, 31), (33, 33), (129, 64), (500, 499), (16, 96)]:
        hf = hf_processor(text="<image>", images=random_images([(width, height)]), return_tensors="pt")
        expected = int(hf["input_ids"].eq(hf_processor.image_token_id).sum())
        assert info.get_num_image_tokens(image_width=width, image_height=height) == expected, (width, height)
    width, height = info.get_image_size_with_most_features()
    hf = hf_processor(text="<image>", images=random_images([(width, height)]), return_tensors="pt")
    assert info.get_max_image_tokens() == int(hf["input_ids"].eq(hf_processor.image_token_id).sum())
    assert info.get_max_image_placeholder_tokens() == hf["input_ids"].shape[1] - 1  # all but <s>


@pytest.mark.parametrize(
    "kwargs", [{"do_image_splitting": False}, {"max_image_size": {"longest_edge": 64}}], ids=["no-split", "tile-64"]
)
def test_processor_kwargs_change_tiles_as_in_hf(idefics3, kwargs):
    """mm_processor_kwargs reach the HF processor, and our token counts and placeholders follow them."""
    folder, _, hf_processor, _, _, _ = idefics3
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_kwargs=kwargs, mm_processor_cache_gb=0)
    sizes = [(200, 30), (60, 90)]
    images = random_images(sizes)
    prompt = "User:<image> and <image>What?"
    hf = hf_processor(text=prompt, images=images, return_tensors="pt", **kwargs)
    out = processor.apply(prompt, {"image": images})
    assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
    default = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=0).apply(prompt, {"image": images})
    assert out["prompt_token_ids"] != default["prompt_token_ids"]
    items = out["mm_kwargs"].get_items("image")
    assert torch.equal(torch.cat([item["pixel_values"].data for item in items]), hf["pixel_values"][0])
    for placeholder in out["mm_placeholders"]["image"]:
        span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
        assert torch.equal(torch.as_tensor(placeholder.is_embed), span.eq(hf_processor.image_token_id))


def test_vision_tower_and_connector_match_hf(idefics3):
    folder, hf_model, hf_processor, _, _, _ = idefics3
    model = load_model(ModelConfig(str(folder), device="cpu"))
    processor = MULTIMODAL_REGISTRY.create_processor(folder)
    images = random_images([(60, 40), (7, 9), (300, 250)], seed=5)
    out = processor.apply("<image><image><image>", {"image": images})
    hf = hf_processor(text="<image><image><image>", images=images, return_tensors="pt")
    with torch.no_grad():
        ours = model.get_multimodal_embeddings(**out["mm_kwargs"])
        expected = hf_model.model.get_image_features(hf["pixel_values"], hf["pixel_attention_mask"]).pooler_output[0]
    assert [e.shape[0] for e in ours] == [int(p.is_embed.sum()) for p in out["mm_placeholders"]["image"]]
    torch.testing.assert_close(torch.cat(ours), expected, atol=1e-5, rtol=0)


def test_vision_tower_masks_padded_patches_as_hf(idefics3):
    """A tile whose lower right is padding (pixel mask 0): positions and attention as HF's."""
    folder, hf_model, _, _, _, _ = idefics3
    model = load_model(ModelConfig(str(folder), device="cpu"))
    pixels = torch.randn(2, 3, 32, 32)
    mask = torch.ones(2, 32, 32, dtype=torch.long)
    mask[1, 20:, :] = 0
    mask[1, :, 12:] = 0
    pixels[1][:, mask[1] == 0] = 0
    patch_mask = mask.unfold(1, 8, 8).unfold(2, 8, 8).sum(dim=(-1, -2)) > 0
    with torch.no_grad():
        ours = model.vision_model(pixels, patch_mask)
        expected = hf_model.model.vision_model(pixels, patch_attention_mask=patch_mask).last_hidden_state
    real = patch_mask.reshape(2, -1)
    torch.testing.assert_close(ours[real], expected[real], atol=1e-5, rtol=0)


def test_prefill_logits_match_hf(idefics3):
    folder, _, _, _, expected, _ = idefics3
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB", enable_prefix_caching=False)
    ((_, logprobs),) = greedy_logprobs(llm, requests()[:1], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


CHUNK = 5


def kv_bytes_per_token(folder) -> int:
    """Both K and V of every layer, fp32."""
    text = ModelConfig(str(folder), device="cpu").hf_config.text_config
    return text.num_hidden_layers * 2 * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * 4


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "prefix-caching", "preemption"])
def test_greedy_tokens_match_hf_alone_and_batched(idefics3, options):
    folder, _, _, hf_two, _, expected = idefics3
    prompt_len = hf_two["input_ids"].shape[1]
    text_len = len(AutoProcessor.from_pretrained(folder).tokenizer.encode(TEXT))
    # the two-image prompt and the text one start together in exactly the blocks they fill; the first
    # new block either needs takes one from the other (block_size 4)
    blocks = -(-prompt_len // 4) + -(-text_len // 4)
    kwargs = {
        "default": {"enable_prefix_caching": False},
        "chunked-prefill": {"max_num_batched_tokens": CHUNK, "enable_prefix_caching": False},
        "prefix-caching": {},
        "preemption": {"kv_cache_memory": blocks * 4 * kv_bytes_per_token(folder), "enable_prefix_caching": False},
    }[options]
    llm = LLM(str(folder), device="cpu", block_size=4, **{"kv_cache_memory": "4MiB", **kwargs})
    if options == "chunked-prefill":  # some chunk starts on a marker or newline inside an image's placeholder
        out = llm.engine.processor.apply(TWO_IMAGES, requests()[0]["multi_modal_data"])
        assert out["prompt_token_ids"] == hf_two["input_ids"][0].tolist()
        starts_on_text = [
            not p.is_embed[start - p.offset]
            for p in out["mm_placeholders"]["image"]
            for start in range(0, prompt_len, CHUNK)
            if p.offset < start < p.offset + p.length
        ]
        assert any(starts_on_text) and not all(starts_on_text)
    assert [tokens(llm, [r])[0] for r in requests()] == expected
    hits = llm.engine.core.block_manager.prefix_hits
    two, one = requests()
    assert tokens(llm, [two, TEXT, one])[::2] == expected  # batched
    if options == "prefix-caching":
        assert llm.engine.core.block_manager.prefix_hits > hits
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0
