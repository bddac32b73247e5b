"""Qwen2.5-VL against Hugging Face transformers on a tiny checkpoint (fp32): the processor's outputs
(second_per_grid_ts included), the window-attention vision tower, prefill logits, M-RoPE positions with
the video time interval, and greedy tokens alone, batched, with chunked prefill, prefix caching and
preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import Qwen2_5_VLForConditionalGeneration as HFQwen2_5_VL

from tessera import LLM, SamplingParams
from tessera.config import ModelConfig
from tessera.models.loader import load_model
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.video import decode_video
from testkit import random_images, random_video, video_bytes
from testkit.generation import greedy_logprobs
from testkit.qwen_vl import build_tiny_qwen2_5_vl, mm_features

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
TEXT = "<|im_start|>user\nWhat is in the image?<|im_end|>\n<|im_start|>assistant\n"
MIXED = f"<|im_start|>user\n{IMAGE} and {VIDEO} Compare them.<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def mixed_data():
    """A 60x40 image (3x2 merged tokens: two windows) and a 6-frame 48x48 video (3 grid frames of 3x3
    merged tokens: four windows each)."""
    return {"image": random_images([(60, 40)], seed=7), "video": [random_video(6, 48, 48, seed=3)]}


def hf_inputs(hf_processor, prompt, data):
    return hf_processor(
        text=prompt, images=data.get("image"), videos=data.get("video"), do_sample_frames=False, return_tensors="pt"
    )


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    """(folder, HF model, HF processor, HF's inputs for MIXED, its last-token log-probs and greedy tokens)."""
    folder = build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl"))
    hf_model = HFQwen2_5_VL.from_pretrained(folder, attn_implementation="eager").eval()
    hf_processor = AutoProcessor.from_pretrained(folder)
    inputs = hf_inputs(hf_processor, MIXED, mixed_data())
    with torch.no_grad():
        logprobs = hf_model(**inputs).logits[0, -1].log_softmax(-1)
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    return folder, hf_model, hf_processor, inputs, logprobs, out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("cache_gb", [0, 1])
def test_processor_matches_hf(qwen2_5_vl, cache_gb):
    folder, _, hf_processor, _, _, _ = qwen2_5_vl
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    prompt = f"{IMAGE} {IMAGE} {IMAGE} and {VIDEO} {VIDEO} What is it?"
    data = {
        "image": random_images([(60, 40), (100, 100), (7, 9)], seed=1),
        "video": [random_video(4, 48, 48, 1), random_video(3, 30, 70, 2)],
    }
    hf = hf_inputs(hf_processor, prompt, data)
    for _ in range(2):  # the second call hits the processor cache when there is one
        out = processor.apply(prompt, data)
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        for modality, pixels_key in [("image", "pixel_values"), ("video", "pixel_values_videos")]:
            items = out["mm_kwargs"].get_items(modality)
            torch.testing.assert_close(torch.cat([item[pixels_key].data for item in items]), hf[pixels_key])
            grids = torch.stack([item[f"{modality}_grid_thw"].data for item in items])
            assert grids.tolist() == hf[f"{modality}_grid_thw"].tolist()
            for placeholder, grid in zip(out["mm_placeholders"][modality], grids):
                assert placeholder.length == int(grid.prod()) // 4
        seconds = [item["second_per_grid_ts"].data for item in out["mm_kwargs"].get_items("video")]
        assert torch.stack(seconds).tolist() == hf["second_per_grid_ts"].tolist()


def test_a_decoded_clip_is_placed_in_time_by_its_frame_rate(qwen2_5_vl):
    """6 of a 24-frame clip's frames at 8 fps: 2 frames a second were kept, so a grid frame (2 frames)
    spans 1 second, as HF's processor computes it from the same metadata."""
    folder, _, hf_processor, _, _, _ = qwen2_5_vl
    clip = decode_video(video_bytes(num_frames=24, width=32, height=32, fps=8), num_frames=6)
    out = MULTIMODAL_REGISTRY.create_processor(folder).apply(VIDEO, {"video": [clip]})
    hf = hf_processor(text=VIDEO, videos=[clip.frames], video_metadata=[clip.metadata], do_sample_frames=False,
                      return_tensors="pt")  # fmt: skip
    (item,) = out["mm_kwargs"].get_items("video")
    assert [item["second_per_grid_ts"].data.item()] == hf["second_per_grid_ts"].tolist() == [1.0]


def test_vision_tower_matches_hf(qwen2_5_vl):
    folder, hf_model, hf_processor, _, _, _ = qwen2_5_vl
    model = load_model(ModelConfig(str(folder), device="cpu"))
    # 3x2, 3x3 (max_pixels: windows of 2x2, 2x1, 1x2 and 1x1 merged tokens), 1x1 and 2x4 merged tokens
    images = random_images([(60, 40), (112, 112), (16, 16), (64, 32)], seed=5)
    inputs = hf_processor.image_processor(images=images, return_tensors="pt")
    assert inputs["image_grid_thw"][1].tolist() == [1, 6, 6]
    videos = hf_processor.video_processor(videos=[random_video(4, 48, 48, 4)], do_sample_frames=False,
                                          return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        ours = model.get_multimodal_embeddings(**inputs) + model.get_multimodal_embeddings(**videos)
        expected = list(hf_model.model.get_image_features(**inputs).pooler_output)
        expected += list(hf_model.model.get_video_features(**videos).pooler_output)
    assert [e.shape for e in ours] == [e.shape for e in expected]
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # outputs reach ~3: fp32 rounding of 4 blocks


def test_prefill_logits_match_hf(qwen2_5_vl):
    folder, _, _, _, expected, _ = qwen2_5_vl
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB", enable_prefix_caching=False)
    request = {"prompt": MIXED, "multi_modal_data": mixed_data()}
    ((_, logprobs),) = greedy_logprobs(llm, [request], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


def test_mrope_positions_match_hf(qwen2_5_vl):
    folder, hf_model, _, hf, _, _ = qwen2_5_vl
    model = load_model(ModelConfig(str(folder), device="cpu"))
    expected, expected_delta = hf_model.model.get_rope_index(
        hf["input_ids"], mm_token_type_ids=hf["mm_token_type_ids"], image_grid_thw=hf["image_grid_thw"],
        video_grid_thw=hf["video_grid_thw"], second_per_grid_ts=hf["second_per_grid_ts"],
        attention_mask=hf["attention_mask"],
    )  # fmt: skip
    out = MULTIMODAL_REGISTRY.create_processor(folder).apply(MIXED, mixed_data())

    positions, delta = model.get_mrope_input_positions(out["prompt_token_ids"], mm_features(out))
    assert positions.tolist() == expected[:, 0].tolist()
    assert delta == int(expected_delta)
    video = out["mm_placeholders"]["video"][0]
    temporal = positions[0, video.offset : video.offset + video.length].unique().tolist()
    assert [p - temporal[0] for p in temporal] == [0, 2, 4]  # 3 grid frames, 25 tokens/s * 2 frames / 24 fps apart


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "prefix-caching", "preemption"])
def test_greedy_tokens_match_hf(qwen2_5_vl, options):
    folder, _, _, _, _, expected = qwen2_5_vl
    kwargs = {
        "default": {"enable_prefix_caching": False},
        # 5-token chunks: the 6-token image and the 27-token video are cut between chunks
        "chunked-prefill": {"max_num_batched_tokens": 5, "enable_prefix_caching": False},
        "prefix-caching": {},
        # 24 blocks of 4 tokens (2 layers x K and V x 2 heads x 8 dims x 4 bytes = 256 bytes a token): the
        # mixed prompt (70 tokens, 18 blocks) and the text one (24 tokens, 6 blocks) start together, and the
        # mixed one needs a 19th block two tokens later
        "preemption": {"kv_cache_memory": 24 * 4 * 256, "enable_prefix_caching": False},
    }[options]
    llm = LLM(str(folder), device="cpu", block_size=4, **{"kv_cache_memory": "4MiB", **kwargs})
    request = {"prompt": MIXED, "multi_modal_data": mixed_data()}
    assert tokens(llm, [request]) == [expected]
    hits = llm.engine.core.block_manager.prefix_hits
    assert tokens(llm, [request, TEXT, request])[::2] == [expected, expected]  # batched
    if options == "prefix-caching":
        assert llm.engine.core.block_manager.prefix_hits > hits
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
