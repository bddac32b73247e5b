"""A short clip of moving shapes, made here, asked about through LLM.chat, the OpenAI server (the
official client) and the CLI of a tiny Qwen2-VL: each answer is HF generate's greedy answer for the
same decoded frames and the same chat template."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch
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
from tessera.testing import random_images, video_bytes
from tessera.testing.qwen_vl import build_tiny_qwen2_vl

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


@pytest.fixture(scope="module")
def hf_answer(qwen2_vl_dir):
    """HF's greedy text for the clip's frames (decoded as the engine decodes them, all 4 kept)."""
    processor = AutoProcessor.from_pretrained(qwen2_vl_dir)
    hf_messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    frames = decode_video(CLIP).frames
    assert len(frames) == 4
    inputs = processor(text=text, videos=[frames], do_sample_frames=False, return_tensors="pt")
    model = HFQwen2VL.from_pretrained(qwen2_vl_dir).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


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
