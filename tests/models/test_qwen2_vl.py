"""Qwen2-VL against Hugging Face transformers on a tiny checkpoint (fp32): the processor's outputs,
the vision tower, prefill logits, and greedy tokens alone, batched, with chunked prefill (chunks
ending inside images), prefix caching and preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import Qwen2VLForConditionalGeneration as HFQwen2VL

from tessera import LLM, SamplingParams
from tessera.config import ModelConfig
from tessera.models.loader import load_model
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.video import decode_video
from testkit import random_images, random_video, video_bytes
from testkit.generation import greedy_logprobs
from testkit.qwen_vl import build_tiny_qwen2_vl, mm_features

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [  # (prompt, image sizes (width, height))
    ("<|im_start|>user\nWhat is in the image?<|im_end|>\n<|im_start|>assistant\n", []),
    (f"<|im_start|>user\n{IMAGE}What colour is the circle?<|im_end|>\n<|im_start|>assistant\n", [(60, 40)]),
    (f"<|im_start|>user\n{IMAGE} and {IMAGE} Compare them.<|im_end|>\n<|im_start|>assistant\n", [(50, 100), (90, 30)]),
]  # fmt: skip
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    """(folder, HF model, HF processor, HF's greedy tokens per PROMPTS entry)."""
    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny_qwen2_vl"))
    hf_model = HFQwen2VL.from_pretrained(folder, attn_implementation="eager").eval()
    hf_processor = AutoProcessor.from_pretrained(folder)
    expected = []
    for i, (prompt, sizes) in enumerate(PROMPTS):
        inputs = hf_processor(text=prompt, images=random_images(sizes, seed=i) or None, return_tensors="pt")
        with torch.no_grad():
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
        expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return folder, hf_model, hf_processor, expected


def request(i: int):
    prompt, sizes = PROMPTS[i]
    return {"prompt": prompt, "multi_modal_data": {"image": random_images(sizes, seed=i)}} if sizes else prompt


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("cache_gb", [0, 1])
@pytest.mark.parametrize(
    "sizes", [[(60, 40)], [(32, 32)], [(50, 100)], [(200, 30)], [(7, 9)], [(60, 40), (33, 70), (100, 100)]]
)
def test_processor_matches_hf(qwen2_vl, sizes, cache_gb):
    folder, _, hf_processor, _ = qwen2_vl
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    prompt = "<|im_start|>user\n" + " and ".join([IMAGE] * len(sizes)) + " What is it?<|im_end|>\n"
    images = random_images(sizes)
    hf = hf_processor(text=prompt, images=images, return_tensors="pt")
    for _ in range(2):  # the second call hits the processor cache when there is one
        out = processor.apply(prompt, {"image": images})
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        items = out["mm_kwargs"].get_items("image")
        torch.testing.assert_close(torch.cat([item["pixel_values"].data for item in items]), hf["pixel_values"])
        grids = torch.stack([item["image_grid_thw"].data for item in items])
        assert grids.tolist() == hf["image_grid_thw"].tolist()
        image_token_id = hf_processor.image_token_id
        for placeholder, grid in zip(out["mm_placeholders"]["image"], grids):
            assert placeholder.length == int(grid.prod()) // 4
            span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
            assert span.eq(image_token_id).all()
        width, height = images[0].size
        assert processor.info.get_num_image_tokens(image_width=width, image_height=height) == int(grids[0].prod()) // 4


def test_max_image_tokens_is_what_the_largest_image_gets(qwen2_vl):
    folder, _, hf_processor, _ = qwen2_vl
    info = MULTIMODAL_REGISTRY.create_processor(folder).info
    width, height = info.get_image_size_with_most_features()
    grid = hf_processor.image_processor(images=random_images([(width, height)]), return_tensors="pt")["image_grid_thw"]
    assert info.get_max_image_tokens() == int(grid.prod()) // 4 == 12  # max_pixels / (16 * 16)


def test_vision_tower_matches_hf(qwen2_vl):
    folder, hf_model, hf_processor, _ = qwen2_vl
    model = load_model(ModelConfig(str(folder), device="cpu"))
    images = random_images([(60, 40), (50, 100), (16, 16)], seed=5)
    inputs = hf_processor.image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        ours = model.get_multimodal_embeddings(**inputs)
        expected = hf_model.model.get_image_features(**inputs).pooler_output
    assert [e.shape for e in ours] == [e.shape for e in expected]
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("i", [0, 2])
def test_prefill_logits_match_hf(qwen2_vl, i):
    folder, hf_model, hf_processor, _ = qwen2_vl
    prompt, sizes = PROMPTS[i]
    images = random_images(sizes, seed=i)
    with torch.no_grad():
        logits = hf_model(**hf_processor(text=prompt, images=images or None, return_tensors="pt")).logits[0]
    expected = logits[-1].log_softmax(-1)
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB", enable_prefix_caching=False)
    ((_, logprobs),) = greedy_logprobs(llm, [request(i)], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


def test_mrope_positions_match_hf(qwen2_vl):
    folder, hf_model, hf_processor, _ = qwen2_vl
    model = load_model(ModelConfig(str(folder), device="cpu"))
    processor = MULTIMODAL_REGISTRY.create_processor(folder)
    prompt, sizes = PROMPTS[2]
    images = random_images(sizes, seed=2)
    hf = hf_processor(text=prompt, images=images, return_tensors="pt")
    expected, expected_delta = hf_model.model.get_rope_index(
        hf["input_ids"], mm_token_type_ids=hf["mm_token_type_ids"], image_grid_thw=hf["image_grid_thw"],
        attention_mask=hf["attention_mask"],
    )  # fmt: skip
    out = processor.apply(prompt, {"image": images})

    positions, delta = model.get_mrope_input_positions(out["prompt_token_ids"], mm_features(out))
    assert positions.tolist() == expected[:, 0].tolist()
    assert delta == int(expected_delta)


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "prefix-caching", "preemption"])
def test_greedy_tokens_match_hf_alone_and_batched(qwen2_vl, options):
    folder, _, _, expected = qwen2_vl
    kwargs = {
        "default": {"enable_prefix_caching": False},
        # 5-token chunks: the 3- to 12-token images of PROMPTS are cut between chunks
        "chunked-prefill": {"max_num_batched_tokens": 5, "enable_prefix_caching": False},
        "prefix-caching": {},
        # 17 blocks of 4 tokens (68 tokens, 256 bytes each): the longest sequence (63) fits, all three do not
        "preemption": {"kv_cache_memory": 17 * 4 * 256, "enable_prefix_caching": False},
    }[options]
    llm = LLM(str(folder), device="cpu", block_size=4, **{"kv_cache_memory": "4MiB", **kwargs})
    assert [tokens(llm, [request(i)])[0] for i in range(len(PROMPTS))] == expected
    hits = llm.engine.core.block_manager.prefix_hits
    assert tokens(llm, [request(i) for i in range(len(PROMPTS))]) == expected
    if options == "prefix-caching":
        assert llm.engine.core.block_manager.prefix_hits > hits
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0


# ---- videos ------------------------------------------------------------------------------------------

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
MIXED = f"<|im_start|>user\n{IMAGE} and {VIDEO} Compare them.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def clip():
    """4 frames 32x32 encoded and decoded again (the media path's frames)."""
    return decode_video(video_bytes(num_frames=4, width=32, height=32, fps=4)).frames


def mixed_data(clip):
    return {"image": random_images([(60, 40)], seed=7), "video": [clip]}


def hf_inputs(hf_processor, prompt, data):
    return hf_processor(
        text=prompt, images=data.get("image"), videos=data.get("video"), do_sample_frames=False, return_tensors="pt"
    )


@pytest.mark.parametrize("cache_gb", [0, 1])
@pytest.mark.parametrize("case", ["clip", "odd-frames", "two-videos", "image-and-video"])
def test_video_processor_matches_hf(qwen2_vl, clip, case, cache_gb):
    folder, _, hf_processor, _ = qwen2_vl
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    prompt, data = {
        "clip": (f"<|im_start|>user\n{VIDEO} What happens?<|im_end|>\n", {"video": [clip]}),
        "odd-frames": (f"{VIDEO} What happens?", {"video": [random_video(3, 56, 40)]}),
        "two-videos": (f"{VIDEO} and {VIDEO}", {"video": [random_video(5, 30, 70, 1), random_video(2, 90, 20, 2)]}),
        "image-and-video": (MIXED, mixed_data(clip)),
    }[case]
    hf = hf_inputs(hf_processor, prompt, data)
    for _ in range(2):  # the second call hits the processor cache when there is one
        out = processor.apply(prompt, data)
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        for modality, pixels_key, token_id in [
            ("image", "pixel_values", hf_processor.image_token_id),
            ("video", "pixel_values_videos", hf_processor.video_token_id),
        ]:
            if modality not in data:
                assert modality not in out["mm_placeholders"]
                continue
            items = out["mm_kwargs"].get_items(modality)
            torch.testing.assert_close(torch.cat([item[pixels_key].data for item in items]), hf[pixels_key])
            grids = torch.stack([item[f"{modality}_grid_thw"].data for item in items])
            assert grids.tolist() == hf[f"{modality}_grid_thw"].tolist()
            for placeholder, grid in zip(out["mm_placeholders"][modality], grids):
                assert placeholder.length == int(grid.prod()) // 4
                span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
                assert span.eq(token_id).all()
    for video, grid in zip(data["video"], hf["video_grid_thw"]):
        frames, height, width, _ = video.shape
        num_tokens = processor.info.get_num_video_tokens(image_width=width, image_height=height, num_frames=frames)
        assert num_tokens == int(grid.prod()) // 4


def test_max_video_tokens_is_what_the_dummy_video_gets(qwen2_vl):
    folder, _, hf_processor, _ = qwen2_vl
    processor = MULTIMODAL_REGISTRY.create_processor(folder)
    counts = {"image": 1, "video": 1}
    (video,) = processor.dummy_inputs.get_dummy_mm_data(1024, counts)["video"]
    grid = hf_processor.video_processor(videos=[video], do_sample_frames=False, return_tensors="pt")["video_grid_thw"]
    assert processor.info.get_mm_max_tokens_per_item(1024, counts)["video"] == int(grid.prod()) // 4 == 48
    assert processor.info.get_max_video_tokens(12 + 24, counts) == 24  # what the sequence leaves after the image


def test_video_tower_matches_hf(qwen2_vl, clip):
    folder, hf_model, hf_processor, _ = qwen2_vl
    model = load_model(ModelConfig(str(folder), device="cpu"))
    inputs = hf_processor.video_processor(videos=[clip, random_video(3, 56, 40)], do_sample_frames=False,
                                          return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        ours = model.get_multimodal_embeddings(**inputs)
        expected = hf_model.model.get_video_features(**inputs).pooler_output
    assert [e.shape for e in ours] == [e.shape for e in expected]
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def hf_mixed(qwen2_vl, clip):
    """HF's inputs for MIXED, its last-token log-probs and its greedy tokens."""
    _, hf_model, hf_processor, _ = qwen2_vl
    inputs = hf_inputs(hf_processor, MIXED, mixed_data(clip))
    with torch.no_grad():
        logprobs = hf_model(**inputs).logits[0, -1].log_softmax(-1)
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    return inputs, logprobs, out[0, inputs["input_ids"].shape[1] :].tolist()


def test_mixed_prefill_logits_match_hf(qwen2_vl, clip, hf_mixed):
    folder = qwen2_vl[0]
    _, expected, _ = hf_mixed
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB", enable_prefix_caching=False)
    request = {"prompt": MIXED, "multi_modal_data": mixed_data(clip)}
    ((_, logprobs),) = greedy_logprobs(llm, [request], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


def test_mixed_mrope_positions_match_hf(qwen2_vl, clip, hf_mixed):
    folder, hf_model, _, _ = qwen2_vl
    hf, _, _ = hf_mixed
    model = load_model(ModelConfig(str(folder), device="cpu"))
    expected, expected_delta = hf_model.model.get_rope_index(
        hf["input_ids"], mm_token_type_ids=hf["mm_token_type_ids"], image_grid_thw=hf["image_grid_thw"],
        video_grid_thw=hf["video_grid_thw"], attention_mask=hf["attention_mask"],
    )  # fmt: skip
    out = MULTIMODAL_REGISTRY.create_processor(folder).apply(MIXED, mixed_data(clip))

    positions, delta = model.get_mrope_input_positions(out["prompt_token_ids"], mm_features(out))
    assert positions.tolist() == expected[:, 0].tolist()
    assert delta == int(expected_delta)


@pytest.mark.parametrize("options", ["default", "chunked-prefill"])
def test_mixed_greedy_tokens_match_hf(qwen2_vl, clip, hf_mixed, options):
    folder = qwen2_vl[0]
    _, _, expected = hf_mixed
    # 5-token chunks: the 8-token video (and the 6-token image) are cut between chunks
    kwargs = {"default": {}, "chunked-prefill": {"max_num_batched_tokens": 5}}[options]
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB", enable_prefix_caching=False, **kwargs)
    request = {"prompt": MIXED, "multi_modal_data": mixed_data(clip)}
    assert tokens(llm, [request]) == [expected]
    assert tokens(llm, [request, PROMPTS[0][0]])[0] == expected  # batched with a text prompt


def test_model_level_max_pixels_bounds_the_largest_image(qwen2_vl):
    """mm_processor_kwargs={"max_pixels": ...} reaches HF's processor at call time; the profile's
    largest image (and so the memory the engine plans for) follows it."""
    folder, _, hf_processor, _ = qwen2_vl
    info = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_kwargs={"max_pixels": 16 * 16 * 5}).info
    width, height = info.get_image_size_with_most_features()
    image = random_images([(width, height)])
    grid = hf_processor(text=IMAGE, images=image, max_pixels=16 * 16 * 5, return_tensors="pt")["image_grid_thw"]
    assert info.get_max_image_tokens() == int(grid.prod()) // 4 == 5  # max_pixels / (16 * 16): 5 merged tokens
