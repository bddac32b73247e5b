"""SmolVLM (SmolVLM2) against Hugging Face transformers on a tiny checkpoint (fp32): the processor's outputs
for images and for videos (frame timestamps from the decoded clip's metadata, or HF's 24 fps guess for
bare frames), token counts, prefill logits of a video prompt, and greedy tokens alone, batched, with
chunked prefill (chunk boundaries on timestamps inside a video's placeholder), prefix caching and
preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import SmolVLMForConditionalGeneration as HFSmolVLM

from tessera import LLM, SamplingParams
from tessera.config import ModelConfig
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.video import decode_video
from testkit import random_images, random_video, video_bytes
from testkit.generation import greedy_logprobs
from testkit.idefics3 import build_tiny_smolvlm

TEXT = "User: What is in the image?<end_of_utterance>\nAssistant:"
ONE_IMAGE = "User:<image>What colour is the circle?<end_of_utterance>\nAssistant:"
VIDEO = "User: <video>What happens?<end_of_utterance>\nAssistant:"
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CHUNK = 5


@pytest.fixture(scope="module")
def clip():
    """6 of the 24 frames of a 3-second 32x32 clip at 8 fps, as the media path decodes it."""
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


def requests(clip):
    return [
        {"prompt": VIDEO, "multi_modal_data": {"video": [clip]}},
        {"prompt": ONE_IMAGE, "multi_modal_data": {"image": random_images([(200, 30)], seed=1)}},
    ]


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory, clip):
    """(folder, HF processor, HF's inputs for VIDEO, its last-token log-probs, HF's greedy tokens for
    VIDEO and ONE_IMAGE)."""
    folder = build_tiny_smolvlm(tmp_path_factory.mktemp("tiny_smolvlm"))
    hf_model = HFSmolVLM.from_pretrained(folder, attn_implementation="eager").eval()
    hf_processor = AutoProcessor.from_pretrained(folder)
    video = hf_inputs(hf_processor, VIDEO, {"video": [clip]})
    image = hf_inputs(hf_processor, ONE_IMAGE, requests(clip)[1]["multi_modal_data"])
    with torch.no_grad():
        logprobs = hf_model(**video).logits[0, -1].log_softmax(-1)
        expected = []
        for inputs in (video, image):
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
            expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return folder, hf_processor, video, logprobs, expected


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("cache_gb", [0, 1])
@pytest.mark.parametrize("case", ["tiny-image", "wide-image", "images", "clip", "bare-video", "two-videos"])
def test_processor_matches_hf(smolvlm, clip, case, cache_gb):
    folder, hf_processor, _, _, _ = smolvlm
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    prompt, data = {
        "tiny-image": ("User:<image>What?", {"image": random_images([(7, 9)])}),
        "wide-image": ("User:<image>What?", {"image": random_images([(200, 30)])}),
        "images": ("User:<image> and <image>What?", {"image": random_images([(60, 40), (30, 200)])}),
        "clip": (VIDEO, {"video": [clip]}),
        "bare-video": (VIDEO, {"video": [random_video(5, 56, 40)]}),  # no metadata: 24 fps, as HF
        "two-videos": ("User: <video> then <video>Compare.", {"video": [random_video(6, 30, 70, 1), clip]}),
    }[case]
    hf = hf_inputs(hf_processor, prompt, data)
    modality = "video" if "video" in data else "image"
    pixels_key, mask_key = {"image": ("pixel_values", "pixel_attention_mask"),
                            "video": ("pixel_values_videos", "pixel_attention_mask_videos")}[modality]  # fmt: skip
    for _ in range(2):  # the second call hits the processor cache when there is one
        out = processor.apply(prompt, data)
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        items = out["mm_kwargs"].get_items(modality)
        torch.testing.assert_close(torch.cat([i[pixels_key].data for i in items]), hf["pixel_values"].flatten(0, 1))
        masks = torch.cat([i[mask_key].data for i in items])
        assert torch.equal(masks, hf["pixel_attention_mask"].flatten(0, 1))
        placeholders = out["mm_placeholders"][modality]
        assert len(placeholders) == len(data[modality])
        for placeholder in placeholders:
            span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
            assert torch.equal(torch.as_tensor(placeholder.is_embed), span.eq(hf_processor.image_token_id))
            assert span[0] == span[-1] == hf_processor.tokenizer.convert_tokens_to_ids("<fake_token_around_image>")
        embeds = sum(int(torch.as_tensor(p.is_embed).sum()) for p in placeholders)
        assert embeds == int(hf["input_ids"].eq(hf_processor.image_token_id).sum())
    info = processor.info
    for placeholder, item in zip(placeholders, data[modality]):
        if modality == "video":
            count = info.get_num_video_tokens(num_frames=len(getattr(item, "frames", item)))
        else:
            count = info.get_num_image_tokens(image_width=item.size[0], image_height=item.size[1])
        assert count == int(torch.as_tensor(placeholder.is_embed).sum())
    if case == "clip":  # frames 0, 4, 9, 13, 18, 23 at 8 fps of a 3-second clip
        text = hf_processor.tokenizer.decode(out["prompt_token_ids"])
        assert "six frames from a 0:00:03" in text and "Frame from 00:02:" in text


def test_prefill_logits_match_hf(smolvlm, clip):
    folder, _, _, expected, _ = smolvlm
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB", enable_prefix_caching=False)
    ((_, logprobs),) = greedy_logprobs(llm, requests(clip)[:1], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


def kv_bytes_per_token(folder) -> int:
    """Both K and V of every layer, fp32."""
    text = ModelConfig(str(folder), device="cpu").hf_config.text_config
    return text.num_hidden_layers * 2 * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * 4


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "prefix-caching", "preemption"])
def test_greedy_tokens_match_hf_alone_and_batched(smolvlm, clip, options):
    folder, hf_processor, hf_video, _, expected = smolvlm
    prompt_len = hf_video["input_ids"].shape[1]
    text_len = len(hf_processor.tokenizer.encode(TEXT))
    # the video prompt and the text one start together in exactly the blocks they fill; the first new
    # block either needs takes one from the other (block_size 4)
    blocks = -(-prompt_len // 4) + -(-text_len // 4)
    kwargs = {
        "default": {"enable_prefix_caching": False},
        "chunked-prefill": {"max_num_batched_tokens": CHUNK, "enable_prefix_caching": False},
        "prefix-caching": {},
        "preemption": {"kv_cache_memory": blocks * 4 * kv_bytes_per_token(folder), "enable_prefix_caching": False},
    }[options]
    # one item of each per prompt keeps the start-up's worst-case profile prompt short (it runs in chunks too)
    limits = {"image": 1, "video": 1}
    llm = LLM(
        str(folder), device="cpu", block_size=4, **{"kv_cache_memory": "4MiB", "limit_mm_per_prompt": limits, **kwargs}
    )
    if options == "chunked-prefill":  # some chunk starts on a timestamp or marker inside the video's placeholder
        out = llm.engine.processor.apply(VIDEO, {"video": [clip]})
        (placeholder,) = out["mm_placeholders"]["video"]
        starts_on_text = [
            not placeholder.is_embed[start - placeholder.offset]
            for start in range(0, prompt_len, CHUNK)
            if placeholder.offset < start < placeholder.offset + placeholder.length
        ]
        assert any(starts_on_text) and not all(starts_on_text)
    assert [tokens(llm, [r])[0] for r in requests(clip)] == expected
    hits = llm.engine.core.block_manager.prefix_hits
    video, image = requests(clip)
    assert tokens(llm, [video, TEXT, image])[::2] == expected  # batched
    if options == "prefix-caching":
        assert llm.engine.core.block_manager.prefix_hits > hits
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_chat_with_a_clip_gets_hf_prompt_and_answer(smolvlm, tmp_path):
    """A clip file through LLM.chat: sampled to 6 of its 24 frames, the prompt (introduction, timestamps
    from the clip's own frame rate) is HF's for those frames with that metadata, and so is the answer."""
    folder, hf_processor, _, _, _ = smolvlm
    path = tmp_path / "clip.mp4"
    path.write_bytes(video_bytes(num_frames=24, width=32, height=32, fps=8))
    decoded = decode_video(path.read_bytes(), num_frames=6)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": str(path)}},
                                             {"type": "text", "text": "What happens?"}]}]  # fmt: skip
    hf_messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    text = hf_processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    inputs = hf_inputs(hf_processor, text, {"video": [decoded]})
    hf_model = HFSmolVLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    llm = LLM(str(folder), device="cpu", kv_cache_memory="4MiB", limit_mm_per_prompt={"image": 1, "video": 1})
    (output,) = llm.chat(messages, GREEDY, use_tqdm=False, media_io_kwargs={"video": {"num_frames": 6}})
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert output.outputs[0].token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def no_video_token(tmp_path_factory):
    """(folder, HF processor) of a SmolVLM2 checkpoint whose tokenizer has no `<video>` token: to it
    `<video>` is plain text, which HF's processor replaces in the prompt's text."""
    folder = build_tiny_smolvlm(tmp_path_factory.mktemp("tiny_smolvlm_no_video_token"), video_token=False)
    hf_processor = AutoProcessor.from_pretrained(folder)
    assert len(hf_processor.tokenizer.encode("<video>", add_special_tokens=False)) > 1  # the case under test
    return folder, hf_processor


@pytest.mark.parametrize("cache_gb", [0, 1])
@pytest.mark.parametrize("form", ["text", "token-ids"])
@pytest.mark.parametrize("case", ["clip", "bare-video", "two-videos", "image-and-video"])
def test_video_placeholder_that_is_no_token_matches_hf(no_video_token, clip, case, form, cache_gb):
    """A text or token-id prompt (the HF tokenizer's ids of the text) gets HF's prompt, each video's
    placeholder is its frames in HF's prompt, and every `<image>` token of HF's prompt is an embedding."""
    folder, hf_processor = no_video_token
    tokenizer = hf_processor.tokenizer
    prompt, data = {
        "clip": (VIDEO, {"video": [clip]}),
        "bare-video": ("User:<video>What happens?", {"video": [random_video(5, 56, 40)]}),
        # as many frames each: HF pads the frames of videos processed together to the longest one's count
        "two-videos": ("User: <video> then<video>Compare.", {"video": [random_video(6, 30, 70, 1), clip]}),
        "image-and-video": ("User:<image>and <video>Compare.", {"image": random_images([(60, 40)]), "video": [clip]}),
    }[case]
    hf = hf_inputs(hf_processor, prompt, data)
    hf_ids = hf["input_ids"][0]
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    given = prompt if form == "text" else tokenizer(prompt)["input_ids"]
    out = processor.apply(given, data)
    assert out["prompt_token_ids"] == hf_ids.tolist()
    placeholders = [p for ranges in out["mm_placeholders"].values() for p in ranges]
    assert len(out["mm_placeholders"]["video"]) == len(data["video"])
    assert len(placeholders) == len(data["video"]) + len(data.get("image", []))
    fake = tokenizer.convert_tokens_to_ids("<fake_token_around_image>")
    is_embed = torch.zeros_like(hf_ids, dtype=torch.bool)
    for placeholder in placeholders:
        span = hf_ids[placeholder.offset : placeholder.offset + placeholder.length]
        assert span[0] == span[-1] == fake
        is_embed[placeholder.offset : placeholder.offset + placeholder.length] = torch.as_tensor(placeholder.is_embed)
    assert torch.equal(is_embed, hf_ids.eq(hf_processor.image_token_id))


def test_engine_without_a_video_token_starts_and_answers_as_hf(no_video_token, clip):
    """The start-up profile runs a worst-case video prompt; then a video prompt gets HF's answer."""
    folder, hf_processor = no_video_token
    inputs = hf_inputs(hf_processor, VIDEO, {"video": [clip]})
    hf_model = HFSmolVLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    llm = LLM(str(folder), device="cpu", kv_cache_memory="4MiB", limit_mm_per_prompt={"image": 1, "video": 1})
    (output,) = llm.generate([{"prompt": VIDEO, "multi_modal_data": {"video": [clip]}}], GREEDY, use_tqdm=False)
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert output.outputs[0].token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()
