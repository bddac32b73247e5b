"""A short clip of moving shapes, made here, asked about through LLM.chat, the OpenAI server (the
official client) and the CLI (`generate --video`, `chat`'s /video) of a tiny Qwen2-VL: each answer
is HF generate's greedy answer for the same decoded frames and the same chat template. The same
frames sent as vLLM's `data:video/jpeg;base64,<frame>,...` URL get HF's answer for the JPEGs as
PIL decodes them, the answer LLM.generate gives for them as an array."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor
from transformers import Qwen2VLForConditionalGeneration as HFQwen2VL

from tessera import LLM, SamplingParams
from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.entrypoints.cli import main
from tessera.entrypoints.openai.api_server import build_app
from tessera.entrypoints.openai.http_server import ServerThread
from tessera.multimodal.media import MediaPolicy
from tessera.multimodal.video import decode_video
from testkit import random_images, video_bytes, video_frame
from testkit.qwen_vl import build_tiny_qwen2_vl

QUESTION, MAX_TOKENS = "What happens in the video?", 8
CLIP = video_bytes(num_frames=4, width=32, height=32, fps=4)
URL = "data:video/mp4;base64," + base64.b64encode(CLIP).decode()
MESSAGES = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": URL}},
                                         {"type": "text", "text": QUESTION}]}]  # fmt: skip
(IMAGE,) = random_images([(40, 30)])
_png = io.BytesIO()
IMAGE.save(_png, format="PNG")
IMAGE_URL = "data:image/png;base64," + base64.b64encode(_png.getvalue()).decode()
MIXED = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE_URL}},
                                      {"type": "video_url", "video_url": {"url": URL}},
                                      {"type": "text", "text": QUESTION}]}]  # fmt: skip


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl_video"))


def hf_prompt(processor, *kinds: str) -> str:
    """The chat template's text for one user turn of `kinds` ("image", "video") then QUESTION."""
    hf_messages = [{"role": "user", "content": [*({"type": k} for k in kinds), {"type": "text", "text": QUESTION}]}]
    return processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)


def hf_generate(model_dir, videos, images=None) -> str:
    """HF's greedy text for QUESTION about the images, then the videos (frames as given, none dropped)."""
    processor = AutoProcessor.from_pretrained(model_dir)
    text = hf_prompt(processor, *["image"] * len(images or []), *["video"] * len(videos))
    inputs = processor(text=text, images=images, videos=videos, do_sample_frames=False, return_tensors="pt")
    model = HFQwen2VL.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.fixture(scope="module")
def hf_answer(qwen2_vl_dir):
    """HF's greedy text for the clip's frames (decoded as the engine decodes them, all 4 kept)."""
    frames = decode_video(CLIP).frames
    assert len(frames) == 4
    return hf_generate(qwen2_vl_dir, [frames])


def test_llm_chat_answers_about_the_clip_as_hf(qwen2_vl_dir, hf_answer):
    llm = LLM(str(qwen2_vl_dir), kv_cache_memory="16MiB")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    (output,) = llm.chat(MESSAGES, params, use_tqdm=False)
    assert output.outputs[0].text == hf_answer


def test_the_server_answers_the_official_client_as_hf_and_tokenize_counts_image_and_video_tokens(
    qwen2_vl_dir, hf_answer
):
    from openai import OpenAI

    engine = AsyncEngine(LLMEngine.from_options(str(qwen2_vl_dir), kv_cache_memory="16MiB"))
    try:
        app = build_app(engine, model_name="qwen", media_policy=MediaPolicy())
        with ServerThread(app) as url:
            client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            reply = client.chat.completions.create(
                model="qwen", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            counted = httpx.post(url + "/tokenize", json={"messages": MIXED}, timeout=60).json()
    finally:
        engine.shutdown()
    assert reply.choices[0].message.content == hf_answer
    # /tokenize counts image and video tokens as the HF processor expands them
    processor = AutoProcessor.from_pretrained(qwen2_vl_dir)
    hf_messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": QUESTION}]}
    ]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    hf_ids = processor(text=text, images=[IMAGE], videos=[decode_video(CLIP).frames], do_sample_frames=False,
                       return_tensors="pt")["input_ids"][0].tolist()  # fmt: skip
    assert counted["count"] == len(hf_ids) and counted["tokens"] == hf_ids
    pads = {m: hf_ids.count(processor.tokenizer.convert_tokens_to_ids(f"<|{m}_pad|>")) for m in ("image", "video")}
    assert {m: [p["length"] for p in ranges] for m, ranges in counted["mm_placeholders"].items()} == {
        "image": [pads["image"]],
        "video": [pads["video"]],
    }


def test_the_cli_answers_about_a_video_file_as_hf(qwen2_vl_dir, hf_answer, tmp_path):
    clip = tmp_path / "shapes.mp4"
    clip.write_bytes(CLIP)
    out = io.StringIO()
    code = main(["generate", QUESTION, "--video", str(clip), "--model", str(qwen2_vl_dir),
                 "--max-tokens", str(MAX_TOKENS)], stdout=out)  # fmt: skip
    assert code == 0
    assert out.getvalue().strip() == hf_answer.strip()


def chat_cli(model_dir, script: str, *options: str) -> list[str]:
    out = io.StringIO()
    code = main(["chat", "--model", str(model_dir), "--max-tokens", str(MAX_TOKENS), *options],
                stdin=io.StringIO(script), stdout=out)  # fmt: skip
    assert code == 0 and "Traceback" not in out.getvalue()
    return out.getvalue().splitlines()


def answers(lines: list[str]) -> list[str]:
    """The model's replies in a chat transcript: after the greeting, the lines but "(...)" notes and
    the last, empty prompt."""
    replies = [line.removeprefix(">").strip() for line in lines[1:]]
    return [reply for reply in replies if reply and not reply.startswith("(")]


def test_chat_video_command_attaches_a_clip_to_the_next_turn_and_refuses_a_bad_one(qwen2_vl_dir, hf_answer, tmp_path):
    clip, bad = tmp_path / "shapes.mp4", tmp_path / "broken.mp4"
    clip.write_bytes(CLIP)
    bad.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 200)  # an MP4 header and nothing behind it
    missing = tmp_path / "missing.mp4"
    lines = chat_cli(qwen2_vl_dir, f"/video {bad}\n/video {missing}\n/video {clip}\n{QUESTION}\n/exit\n")
    assert any(line.startswith("> (not attached: The video could not be decoded") for line in lines), lines
    assert f"> (not attached: Video file {missing} does not exist.)" in lines
    assert f"> (attached {clip})" in lines
    assert answers(lines) == [hf_answer.strip()]


def test_chat_video_honours_media_io_kwargs_when_checked_and_when_sampled(qwen2_vl_dir, tmp_path):
    clip = tmp_path / "shapes.mp4"
    clip.write_bytes(CLIP)
    # 2 of the 4 frames: np.linspace(0, 3, 2) rounded down keeps frames 0 and 3 (vLLM's sampling)
    expected = hf_generate(qwen2_vl_dir, [decode_video(CLIP, num_frames=-1).frames[[0, 3]]])
    lines = chat_cli(qwen2_vl_dir, f"/video {clip}\n{QUESTION}\n/exit\n", "--media-io-kwargs",
                     '{"video": {"num_frames": 2}}')  # fmt: skip
    assert answers(lines) == [expected.strip()]
    lines = chat_cli(qwen2_vl_dir, f"/video {clip}\n/exit\n", "--media-io-kwargs", '{"video": {"num_frames": 100000}}')
    assert any(line.startswith("> (not attached: num_frames=100000 is over the limit") for line in lines), lines


def test_chat_attaches_images_and_videos_in_the_order_given(qwen2_vl_dir, tmp_path):
    clip, image = tmp_path / "shapes.mp4", tmp_path / "image.png"
    clip.write_bytes(CLIP)
    IMAGE.save(image)
    expected = hf_generate(qwen2_vl_dir, [decode_video(CLIP).frames], images=[IMAGE])  # the image, then the clip
    lines = chat_cli(qwen2_vl_dir, f"/image {image}\n/video {clip}\n{QUESTION}\n/exit\n")
    assert answers(lines) == [expected.strip()]


# ---- vLLM's data:video/jpeg URLs: a video as base64 JPEG frames joined by commas ----------------------------------


def jpeg(frame: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


JPEGS = [jpeg(video_frame(i, 32, 32)) for i in range(4)]
JPEG_URL = "data:video/jpeg;base64," + ",".join(base64.b64encode(j).decode() for j in JPEGS)
# the frames as PIL decodes each JPEG (vLLM: ImageMediaIO.load_base64("image/jpeg", part) per part, stacked)
JPEG_FRAMES = np.stack([np.asarray(Image.open(io.BytesIO(j)).convert("RGB")) for j in JPEGS])
JPEG_MESSAGES = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": JPEG_URL}},
                                              {"type": "text", "text": QUESTION}]}]  # fmt: skip


def test_jpeg_frames_url_through_llm_chat_and_the_server_answers_as_the_frames_as_an_array(qwen2_vl_dir):
    expected = hf_generate(qwen2_vl_dir, [JPEG_FRAMES])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(str(qwen2_vl_dir), kv_cache_memory="16MiB")
    prompt = hf_prompt(AutoProcessor.from_pretrained(qwen2_vl_dir), "video")
    (as_array,) = llm.generate({"prompt": prompt, "multi_modal_data": {"video": JPEG_FRAMES}}, params, use_tqdm=False)
    (chat,) = llm.chat(JPEG_MESSAGES, params, use_tqdm=False)
    assert chat.outputs[0].text == as_array.outputs[0].text == expected
    del llm

    engine = AsyncEngine(LLMEngine.from_options(str(qwen2_vl_dir), kv_cache_memory="16MiB"))
    try:
        with ServerThread(build_app(engine, model_name="qwen", media_policy=MediaPolicy())) as url:
            body = {"model": "qwen", "messages": JPEG_MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "ignore_eos": True}  # fmt: skip
            reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            sampled = httpx.post(url + "/v1/chat/completions", timeout=60,
                                 json={**body, "media_io_kwargs": {"video": {"num_frames": 2}}})  # fmt: skip
    finally:
        engine.shutdown()
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == expected
    # num_frames=2 of 4 frames whose rate is unknown: frames 0 and 3
    assert sampled.json()["choices"][0]["message"]["content"] == hf_generate(qwen2_vl_dir, [JPEG_FRAMES[[0, 3]]])
