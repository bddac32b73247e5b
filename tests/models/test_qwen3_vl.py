"""Qwen3-VL against Hugging Face transformers on a tiny checkpoint (fp32): the processor's outputs (video
timestamps in the prompt from the decoded clip's metadata), the vision tower with its DeepStack features,
M-RoPE positions frame by frame, prefill logits, and greedy tokens alone, batched, with chunked prefill
(chunks ending inside an image and a video), prefix caching and preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import Qwen3VLForConditionalGeneration as HFQwen3VL

from tessera import LLM, SamplingParams
from tessera.config import ModelConfig
from tessera.models.loader import load_model
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.video import decode_video
from testkit import random_images, random_video, video_bytes
from testkit.generation import greedy_logprobs
from testkit.qwen_vl import build_tiny_qwen3_vl, mm_features

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
TEXT = "<|im_start|>user\nWhat is in the image?<|im_end|>\n<|im_start|>assistant\n"
ONE_IMAGE = f"<|im_start|>user\n{IMAGE}What colour is the circle?<|im_end|>\n<|im_start|>assistant\n"
MIXED = f"<|im_start|>user\n{IMAGE} and {VIDEO} Compare them.<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def clip():
    """6 of the 24 frames of a 3-second 32x32 clip at 8 fps, as the media path decodes it (VideoFrames:
    frames with the clip's fps and the indices of the frames kept)."""
    return decode_video(video_bytes(num_frames=24, width=32, height=32, fps=8), num_frames=6)


def hf_inputs(hf_processor, prompt, data):
    """HF's processor on the frames as given, with the metadata of those that came from a file."""
    videos = data.get("video") or []
    kwargs = {}
    if any(hasattr(v, "metadata") for v in videos):
        kwargs["video_metadata"] = [v.metadata if hasattr(v, "metadata") else bare(v) for v in videos]
    frames = [v.frames if hasattr(v, "frames") else v for v in videos] or None
    return hf_processor(
        text=prompt, images=data.get("image"), videos=frames, do_sample_frames=False, return_tensors="pt", **kwargs
    )


def bare(video):
    return {"total_num_frames": len(video), "fps": None, "frames_indices": list(range(len(video)))}


def mixed_data(clip):
    return {"image": random_images([(60, 40)], seed=7), "video": [clip]}


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory, clip):
    """(folder, HF model, HF processor, HF's inputs for MIXED, its last-token log-probs, greedy tokens
    for MIXED and for ONE_IMAGE)."""
    folder = build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny_qwen3_vl"))
    hf_model = HFQwen3VL.from_pretrained(folder, attn_implementation="eager").eval()
    hf_processor = AutoProcessor.from_pretrained(folder)
    inputs = hf_inputs(hf_processor, MIXED, mixed_data(clip))
    one_image = hf_inputs(hf_processor, ONE_IMAGE, {"image": random_images([(50, 100)], seed=1)})
    with torch.no_grad():
        logprobs = hf_model(**inputs).logits[0, -1].log_softmax(-1)
        expected = []
        for hf in (inputs, one_image):
            out = hf_model.generate(**hf, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
            expected.append(out[0, hf["input_ids"].shape[1] :].tolist())
    return folder, hf_model, hf_processor, inputs, logprobs, expected


def requests(clip):
    return [
        {"prompt": MIXED, "multi_modal_data": mixed_data(clip)},
        {"prompt": ONE_IMAGE, "multi_modal_data": {"image": random_images([(50, 100)], seed=1)}},
    ]


@pytest.mark.parametrize("cache_gb", [0, 1])
@pytest.mark.parametrize("case", ["images", "clip", "bare-video", "two-videos", "image-and-video"])
def test_processor_matches_hf(qwen3_vl, clip, case, cache_gb):
    folder, _, hf_processor, _, _, _ = qwen3_vl
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    prompt, data = {
        "images": (f"{IMAGE} {IMAGE} and {IMAGE} What?", {"image": random_images([(60, 40), (200, 30), (7, 9)])}),
        "clip": (f"<|im_start|>user\n{VIDEO} What happens?<|im_end|>\n", {"video": [clip]}),
        "bare-video": (f"{VIDEO} What happens?", {"video": [random_video(5, 56, 40)]}),
        "two-videos": (f"{VIDEO} and {VIDEO}", {"video": [random_video(4, 30, 70, 1), clip]}),
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
                continue
            items = out["mm_kwargs"].get_items(modality)
            torch.testing.assert_close(torch.cat([item[pixels_key].data for item in items]), hf[pixels_key])
            grids = torch.stack([item[f"{modality}_grid_thw"].data for item in items])
            assert grids.tolist() == hf[f"{modality}_grid_thw"].tolist()
            for placeholder, grid in zip(out["mm_placeholders"][modality], grids):
                span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
                embeds = span.eq(token_id) if placeholder.is_embed is None else torch.as_tensor(placeholder.is_embed)
                assert embeds.sum() == span.eq(token_id).sum() == int(grid.prod()) // 4
    if case == "clip":  # frames 0, 4, 9, 13, 18, 23 at 8 fps: patches at (0 + 4) / 16, (9 + 13) / 16, (18 + 23) / 16
        text = hf_processor.tokenizer.decode(out["prompt_token_ids"])
        assert "<0.2 seconds>" in text and "<1.4 seconds>" in text and "<2.6 seconds>" in text


def test_video_tokens_counted_as_hf(qwen3_vl):
    folder, _, hf_processor, _, _, _ = qwen3_vl
    info = MULTIMODAL_REGISTRY.create_processor(folder).info
    for frames, width, height in [(4, 30, 70), (8, 64, 64), (2, 200, 100)]:
        grid = hf_processor.video_processor(videos=[random_video(frames, width, height)], do_sample_frames=False,
                                            return_tensors="pt")["video_grid_thw"]  # fmt: skip
        count = info.get_num_video_tokens(image_width=width, image_height=height, num_frames=frames)
        assert count == int(grid.prod()) // 4


def test_vision_tower_and_deepstack_match_hf(qwen3_vl, clip):
    folder, hf_model, hf_processor, _, _, _ = qwen3_vl
    model = load_model(ModelConfig(str(folder), device="cpu"))
    images = hf_processor.image_processor(images=random_images([(60, 40), (50, 100), (16, 16)], seed=5),
                                          return_tensors="pt")  # fmt: skip
    videos = hf_processor.video_processor(videos=[clip.frames], do_sample_frames=False, return_tensors="pt")
    hidden = model.hidden_size
    hf_features = {"image": hf_model.model.get_image_features, "video": hf_model.model.get_video_features}
    with torch.no_grad():
        for modality, inputs in [("image", images), ("video", videos)]:
            ours = model.get_multimodal_embeddings(**inputs)  # per item [n, hidden * (1 + 2)]
            hf = hf_features[modality](**inputs)
            assert [e.shape[0] for e in ours] == [e.shape[0] for e in hf.pooler_output]
            for i, item in enumerate(ours):
                torch.testing.assert_close(item[:, :hidden], hf.pooler_output[i], atol=1e-5, rtol=0)
                for k, deepstack in enumerate(hf.deepstack_features):  # DeepStack feature k after the merged tokens
                    ours_k = item[:, hidden * (k + 1) : hidden * (k + 2)]
                    torch.testing.assert_close(ours_k, deepstack[i], atol=1e-5, rtol=0)


def test_mrope_positions_match_hf(qwen3_vl, clip):
    folder, hf_model, _, hf, _, _ = qwen3_vl
    model = load_model(ModelConfig(str(folder), device="cpu"))
    expected, expected_delta = hf_model.model.get_rope_index(
        hf["input_ids"], mm_token_type_ids=hf["mm_token_type_ids"], image_grid_thw=hf["image_grid_thw"],
        video_grid_thw=hf["video_grid_thw"], attention_mask=hf["attention_mask"],
    )  # fmt: skip
    out = MULTIMODAL_REGISTRY.create_processor(folder).apply(MIXED, mixed_data(clip))

    positions, delta = model.get_mrope_input_positions(out["prompt_token_ids"], mm_features(out))
    assert positions.tolist() == expected[:, 0].tolist()
    assert delta == int(expected_delta)


def test_prefill_logits_match_hf(qwen3_vl, clip):
    folder, _, _, _, expected, _ = qwen3_vl
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB", enable_prefix_caching=False)
    ((_, logprobs),) = greedy_logprobs(llm, requests(clip)[:1], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "prefix-caching", "preemption"])
def test_greedy_tokens_match_hf_alone_and_batched(qwen3_vl, clip, options):
    folder, _, _, _, _, expected = qwen3_vl
    kwargs = {
        "default": {"enable_prefix_caching": False},
        # 5-token chunks: the 6-token image and the video's 3 runs of 4 pads are cut between chunks
        "chunked-prefill": {"max_num_batched_tokens": 5, "enable_prefix_caching": False},
        "prefix-caching": {},
        # 30 blocks of 4 tokens (3 layers x K and V x 2 heads x 8 dims x 4 bytes = 384 bytes a token): the
        # mixed prompt (94 tokens, 24 blocks) and the text one (24 tokens, 6 blocks) start together, and the
        # mixed one needs a 25th block two tokens later
        "preemption": {"kv_cache_memory": 30 * 4 * 384, "enable_prefix_caching": False},
    }[options]
    llm = LLM(str(folder), device="cpu", block_size=4, **{"kv_cache_memory": "4MiB", **kwargs})
    assert [tokens(llm, [r])[0] for r in requests(clip)] == expected
    hits = llm.engine.core.block_manager.prefix_hits
    mixed, one_image = requests(clip)
    assert tokens(llm, [mixed, TEXT, one_image])[::2] == expected  # batched
    if options == "prefix-caching":
        assert llm.engine.core.block_manager.prefix_hits > hits
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_chat_with_a_clip_gets_hf_answer_with_its_timestamps(qwen3_vl, tmp_path):
    """A clip file through LLM.chat: sampled to 6 of its 24 frames, the prompt's timestamps come from
    the clip's own frame rate, and the answer is HF's for those frames with that metadata."""
    folder, hf_model, hf_processor, _, _, _ = qwen3_vl
    path = tmp_path / "clip.mp4"
    path.write_bytes(video_bytes(num_frames=24, width=32, height=32, fps=8))
    decoded = decode_video(path.read_bytes(), num_frames=6)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": str(path)}},
                                             {"type": "text", "text": "What happens?"}]}]  # fmt: skip
    hf_messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    text = hf_processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    inputs = hf_inputs(hf_processor, text, {"video": [decoded]})
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    llm = LLM(str(folder), device="cpu", kv_cache_memory="4MiB")
    (output,) = llm.chat(messages, GREEDY, use_tqdm=False, media_io_kwargs={"video": {"num_frames": 6}})
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert "<2.6 seconds>" in hf_processor.tokenizer.decode(output.prompt_token_ids)  # frames 18 and 23 at 8 fps
    assert output.outputs[0].token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()


def test_a_video_shorter_than_a_temporal_patch_is_refused_clearly(qwen3_vl):
    llm = LLM(str(qwen3_vl[0]), device="cpu", kv_cache_memory="4MiB")
    with pytest.raises(ValueError, match="at least 2 frames"):
        llm.generate({"prompt": VIDEO, "multi_modal_data": {"video": [random_video(1, 32, 32)]}}, GREEDY)
    assert tokens(llm, [TEXT]) and llm.engine.core.scheduler.has_unfinished_requests() is False
