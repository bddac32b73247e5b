"""Qwen2.5-Omni's thinker against Hugging Face transformers on a tiny checkpoint (fp32): the processor's token ids
and features for audio, an image and a video in one prompt, and for a video heard with its sound track
(use_audio_in_video, one and two 2-second chunks); the audio encoder; TMRoPE positions; prefill logits; greedy
tokens alone, batched with an image request, in prefill chunks, from the prefix cache and under preemption; and
a chat with input_audio, image_url and video_url parts."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor
from transformers import Qwen2_5OmniThinkerForConditionalGeneration as HFThinker

from tessera import LLM, SamplingParams
from tessera.errors import InputError
from tessera.multimodal.audio import resample
from tessera.multimodal.inputs import MultiModalKwargs
from testkit.audio import random_audio, wav_bytes
from testkit.generation import greedy_logprobs
from testkit.qwen2_5_omni import build_tiny_qwen2_5_omni

AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
IMAGE = "<|vision_bos|><|IMAGE|><|vision_eos|>"
VIDEO = "<|vision_bos|><|VIDEO|><|vision_eos|>"
MAX_TOKENS = 8
MAX_MODEL_LEN = 1024  # the start-up profile runs the longest item this allows: kept short
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
IN_VIDEO = {"use_audio_in_video": True}


def user(body: str) -> str:
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 56, 3), dtype=np.uint8))


def clip(frames: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, 56, 56, 3), dtype=np.uint8)


def cases():
    """(name, prompt, multi_modal_data, mm_processor_kwargs), each a request."""
    return [
        ("mixed", user(AUDIO + IMAGE + VIDEO + "What happens?"),
         {"audio": [random_audio(1.5, seed=1)], "image": [picture(2)], "video": [clip(4, 3)]}, {}),
        ("video-with-audio", user(IMAGE + VIDEO + "What is said?"),
         {"audio": [random_audio(1.5, seed=4)], "image": [picture(5)], "video": [clip(4, 6)]}, IN_VIDEO),
        ("two-chunks", user(VIDEO + "And now?"), {"audio": [random_audio(4.0, seed=7)], "video": [clip(8, 8)]},
         IN_VIDEO),
        ("image", user(IMAGE + "Describe it."), {"image": [picture(9)]}, {}),
    ]  # fmt: skip


def hf_inputs(processor, prompt, data, kwargs):
    options = dict(text=prompt, images=data.get("image"), videos=data.get("video"), audio=data.get("audio"),
                   return_tensors="pt")  # fmt: skip
    if kwargs:
        options.update(audio_from_video_indices=list(range(len(data["video"]))), use_audio_in_video=True)
    return processor(**{k: v for k, v in options.items() if v is not None})


def request(prompt, data, kwargs):
    return {"prompt": prompt, "multi_modal_data": data, **({"mm_processor_kwargs": kwargs} if kwargs else {})}


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    """(folder, HF model, HF processor, HF's last-token log-probs for the first case, greedy tokens per case)."""
    folder = build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("tiny_omni"))
    hf_model = HFThinker.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    expected = []
    with torch.no_grad():
        for name, prompt, data, kwargs in cases():
            inputs = hf_inputs(processor, prompt, data, kwargs)
            if name == "mixed":
                logprobs = hf_model(**inputs).logits[0, -1].log_softmax(-1)
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                    use_audio_in_video=bool(kwargs))  # fmt: skip
            expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return folder, hf_model, processor, logprobs, expected


@pytest.mark.parametrize("case", range(3), ids=["mixed", "video-with-audio", "two-chunks"])
def test_processor_matches_hf(omni, case):
    folder, _, processor, _, _ = omni
    _, prompt, data, kwargs = cases()[case]
    hf = hf_inputs(processor, prompt, data, kwargs)
    llm = LLM(str(folder), device="cpu", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    ours = llm.engine.processor.apply(prompt, data, kwargs)
    assert ours["prompt_token_ids"] == hf["input_ids"][0].tolist()
    kw = ours["mm_kwargs"]
    if kwargs:  # the tracks travel with their videos
        assert kw.get_item_count("audio") == 0
        tracks = torch.stack([item["video_input_features"].data for item in kw.get_items("video")])
        torch.testing.assert_close(tracks, hf["input_features"])
    else:
        (item,) = kw.get_items("audio")
        torch.testing.assert_close(item["input_features"].data, hf["input_features"][0])
    videos = torch.cat([item["pixel_values_videos"].data for item in kw.get_items("video")])
    torch.testing.assert_close(videos, hf["pixel_values_videos"])


@pytest.mark.parametrize("case", range(3), ids=["mixed", "video-with-audio", "two-chunks"])
def test_positions_and_embeddings_match_hf(omni, case):
    folder, hf_model, processor, _, _ = omni
    _, prompt, data, kwargs = cases()[case]
    hf = hf_inputs(processor, prompt, data, kwargs)
    llm = LLM(str(folder), device="cpu", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    inputs = llm.engine.input_preprocessor.process(request(prompt, data, kwargs), GREEDY)
    positions, delta = llm.engine.core.model.get_mrope_input_positions(inputs.token_ids, inputs.mm_items)
    hf_positions, hf_delta = hf_model.model.get_rope_index(
        hf["input_ids"], hf.get("image_grid_thw"), hf.get("video_grid_thw"), hf["attention_mask"], bool(kwargs),
        hf["feature_attention_mask"].sum(-1), hf.get("video_second_per_grid"),
    )  # fmt: skip
    assert torch.equal(positions, hf_positions[:, 0]) and delta == int(hf_delta)
    with torch.no_grad():
        audio = hf_model.get_audio_features(hf["input_features"], hf["feature_attention_mask"]).pooler_output
    model = llm.engine.core.model
    with torch.no_grad():
        if kwargs:
            video = next(i for i in inputs.mm_items if i.modality == "video")
            (mine,) = model.get_multimodal_embeddings(**MultiModalKwargs.from_items([video.kwargs]))
            is_audio = torch.tensor(inputs.token_ids[video.start : video.end]) == hf_model.config.audio_token_id
            embed = torch.as_tensor(video.placeholder.is_embed)  # the track's tokens among the video's
            torch.testing.assert_close(mine[is_audio[embed]], audio)
        else:
            item = next(i for i in inputs.mm_items if i.modality == "audio")
            (mine,) = model.get_multimodal_embeddings(**MultiModalKwargs.from_items([item.kwargs]))
            torch.testing.assert_close(mine, audio)


def test_prefill_logits_match_hf(omni):
    folder, _, _, expected, _ = omni
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    ((_, logprobs),) = greedy_logprobs(llm, [request(*cases()[0][1:])], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "prefix-caching", "preemption"])
def test_greedy_tokens_match_hf_alone_and_batched(omni, options):
    folder, _, _, _, expected = omni
    requests = [request(*case[1:]) for case in cases()]
    probe = LLM(str(folder), device="cpu", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    lengths = [len(probe.engine.input_preprocessor.process(r, GREEDY).token_ids) for r in requests]
    # 2 layers x K and V x 2 heads x 8 dims x 4 bytes = 256 bytes a token: blocks of 4 for exactly the prompts
    # batched below, so that generating needs blocks that only a preemption frees
    blocks = sum(-(-n // 4) for n in lengths)
    kwargs = {
        "default": {"enable_prefix_caching": False},
        "chunked-prefill": {"max_num_batched_tokens": 48, "enable_prefix_caching": False},
        "prefix-caching": {},
        "preemption": {"kv_cache_memory": blocks * 4 * 256, "enable_prefix_caching": False, "max_model_len": 1024},
    }[options]
    llm = LLM(
        str(folder),
        device="cpu",
        block_size=4,
        **{"kv_cache_memory": "16MiB", "max_model_len": MAX_MODEL_LEN, **kwargs},
    )
    assert [tokens(llm, [r])[0] for r in requests] == expected
    hits = llm.engine.core.block_manager.prefix_hits
    assert tokens(llm, requests) == expected  # batched: audio, video with its track, images
    if options == "prefix-caching":
        assert llm.engine.core.block_manager.prefix_hits > hits
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_chat_with_audio_image_and_video_parts_gets_hfs_answer(omni, tmp_path):
    from testkit import video_bytes

    folder, hf_model, processor, _, _ = omni
    image_path, video_path = tmp_path / "a.png", tmp_path / "v.mp4"
    picture(11).save(image_path)
    video_path.write_bytes(video_bytes(num_frames=4, width=56, height=56, fps=2))
    recording = wav_bytes(random_audio(1.2, seed=12))
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(recording).decode(), "format": "wav"}},
        {"type": "image_url", "image_url": {"url": str(image_path)}},
        {"type": "video_url", "video_url": {"url": str(video_path)}},
        {"type": "text", "text": "What is going on?"},
    ]}]  # fmt: skip
    llm = LLM(str(folder), device="cpu", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    prompt = llm.render_chat(messages)
    hf_messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "image"}, {"type": "video"},
                                                {"type": "text", "text": "What is going on?"}]}]  # fmt: skip
    assert prompt["prompt"] == processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    (video,) = prompt["multi_modal_data"]["video"]
    ((waveform, rate),) = prompt["multi_modal_data"]["audio"]
    inputs = hf_inputs(processor, prompt["prompt"], {"audio": [waveform], "image": [Image.open(image_path)],
                                                     "video": [video.frames]}, {})  # fmt: skip
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    (output,) = llm.chat(messages, GREEDY, use_tqdm=False)
    assert rate == 16000 and output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert output.outputs[0].token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()


def test_audio_in_video_needs_one_track_per_video(omni):
    llm = LLM(str(omni[0]), device="cpu", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    data = {"audio": [random_audio(1.0), random_audio(1.0)], "video": [clip(4, 1)]}
    with pytest.raises(InputError, match="2 audio item\\(s\\) for 1 video"):
        llm.generate(request(user(VIDEO), data, IN_VIDEO), GREEDY)
    assert tokens(llm, [request(*cases()[3][1:])])  # the engine still answers


def test_a_chat_video_heard_with_its_sound_track_gets_hfs_answer_offline_and_served(omni, tmp_path):
    """use_audio_in_video in a chat: the video_url part's file is decoded with its sound track, which HF's
    processor hears with the video (audio_from_video_indices); the server gives the offline answer."""
    import openai

    from tessera.engine.async_engine import AsyncEngine
    from tessera.engine.llm_engine import LLMEngine
    from tessera.entrypoints.openai.api_server import ServerThread, build_app
    from tessera.multimodal.video import decode_video
    from testkit import video_bytes

    folder, hf_model, processor, _, _ = omni
    data = video_bytes(num_frames=4, width=56, height=56, fps=2, audio=random_audio(2.0, seed=13))
    (tmp_path / "talk.mp4").write_bytes(data)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "What is said?"}]}]  # fmt: skip
    llm = LLM(str(folder), device="cpu", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    (output,) = llm.chat(messages, GREEDY, use_tqdm=False, mm_processor_kwargs=IN_VIDEO)
    video = decode_video(data, with_audio=True)
    track = resample(*video.audio, 16000)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What is said?"}]}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    inputs = processor(text=text, videos=[video.frames], audio=[track], audio_from_video_indices=[0],
                       use_audio_in_video=True, return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                use_audio_in_video=True)  # fmt: skip
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert output.outputs[0].token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()

    engine = AsyncEngine(LLMEngine.from_options(str(folder), kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN))
    try:
        with ServerThread(build_app(engine, model_name="omni")) as server:
            client = openai.OpenAI(base_url=server + "/v1", api_key="none")
            reply = client.chat.completions.create(
                model="omni", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True, "mm_processor_kwargs": IN_VIDEO},
            )  # fmt: skip
            mute = base64.b64encode(video_bytes(num_frames=4, width=56, height=56)).decode()
            silent = "data:video/mp4;base64," + mute
            bad = client.with_options(max_retries=0).chat.completions
            with pytest.raises(openai.BadRequestError, match="sound track"):
                bad.create(model="omni", max_tokens=2, extra_body={"mm_processor_kwargs": IN_VIDEO}, messages=[
                    {"role": "user", "content": [{"type": "video_url", "video_url": {"url": silent}}]}])  # fmt: skip
    finally:
        engine.shutdown()
    assert reply.choices[0].message.content == output.outputs[0].text
