"""The tiling VLMs (LLaVA-NeXT, LLaVA-OneVision, Idefics3, SmolVLM), Gemma 3, Mistral 3 and InternVL
behind the OpenAI-compatible server, on tiny checkpoints: the official `openai` client sends two images
in one message and gets HF `generate`'s greedy answer for the same chat template and images, and
`/tokenize` gives the HF processor's tokens for one image of each size of a table (tiny, square, very
wide, very tall, larger than the largest grid)."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.entrypoints.openai.api_server import build_app
from tessera.entrypoints.openai.http_server import ServerThread
from tessera.multimodal.media import MediaPolicy
from testkit import random_images
from testkit.gemma3 import build_tiny_gemma3
from testkit.idefics3 import build_tiny_idefics3, build_tiny_smolvlm
from testkit.internvl import build_tiny_internvl
from testkit.llava_next import build_tiny_llava_next, build_tiny_llava_onevision
from testkit.mistral3 import build_tiny_mistral3

BUILDERS = {
    "llava_next": build_tiny_llava_next,
    "llava_onevision": build_tiny_llava_onevision,
    "idefics3": build_tiny_idefics3,
    "smolvlm": build_tiny_smolvlm,
    "gemma3": build_tiny_gemma3,
    "mistral3": build_tiny_mistral3,
    "internvl": build_tiny_internvl,
}
QUESTION, MAX_TOKENS = "Compare the two pictures.", 8
TWO_IMAGES = [(60, 40), (30, 90)]  # (width, height)
SIZES = [(7, 9), (64, 64), (200, 30), (30, 200), (500, 400)]


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def messages(images, question: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def hf_inputs(processor, images, question: str = QUESTION, **kwargs):
    """The HF processor's inputs for the chat: its template rendered, then tokenized with the images. A
    template that writes the BOS itself (Gemma 3's) gets no second one from the tokenizer, as HF's own
    `apply_chat_template(tokenize=True)` tokenizes without special tokens."""
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    bos = processor.tokenizer.bos_token
    if bos and text.startswith(bos):
        kwargs["add_special_tokens"] = False
    return processor(text=text, images=images, **kwargs)


@pytest.fixture(scope="module", params=list(BUILDERS))
def served(request, tmp_path_factory):
    """(model folder, server URL) for each model."""
    folder = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    engine = AsyncEngine(LLMEngine.from_options(str(folder), kv_cache_memory="16MiB", limit_mm_per_prompt={"image": 2}))
    app = build_app(engine, model_name="tiny", media_policy=MediaPolicy())
    try:
        with ServerThread(app) as url:
            yield folder, url
    finally:
        engine.shutdown()


def test_two_images_in_one_message_get_hf_answer(served):
    from openai import OpenAI

    folder, url = served
    images = random_images(TWO_IMAGES, seed=3)
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="tiny", messages=messages(images), max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
    )
    processor = AutoProcessor.from_pretrained(folder)
    inputs = hf_inputs(processor, images, return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1]


@pytest.mark.parametrize("size", SIZES)
def test_tokenize_counts_as_hf(served, size):
    folder, url = served
    (image,) = random_images([size], seed=1)
    counted = httpx.post(url + "/tokenize", json={"messages": messages([image], "What is it?")}, timeout=60).json()
    processor = AutoProcessor.from_pretrained(folder)
    hf_ids = hf_inputs(processor, [image], "What is it?")["input_ids"][0]
    assert counted["tokens"] == list(hf_ids) and counted["count"] == len(hf_ids)


def test_request_processor_options_get_hf_answer(served, request):
    """A request's mm_processor_kwargs (each family's options of tests/models/test_processor_options_per_family.py,
    which change the image's token count, or its pixels where the family has no such option) give HF's prompt
    tokens and greedy answer with the same options."""
    from tests.models.test_processor_options_per_family import FAMILIES

    folder, url = served
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    for case in FAMILIES[request.node.callspec.params["served"]].cases.values():
        images = random_images([case.size], seed=1)
        body = {"model": "tiny", "messages": messages(images, "What is it?"), "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "mm_processor_kwargs": case.options}  # fmt: skip
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
        inputs = hf_inputs(processor, images, "What is it?", return_tensors="pt", **case.options)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
        expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        assert reply["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1], case
        assert reply["choices"][0]["message"]["content"] == expected, case
