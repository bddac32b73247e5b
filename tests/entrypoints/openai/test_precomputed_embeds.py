"""Precomputed embeddings (vLLM's shapes, each behind its flag): `image_embeds` chat parts (--enable-mm-embeds) made
by the demo model's own encoder answer as the image does; `prompt_embeds` (--enable-prompt-embeds, and offline)
made by its embedding table answer as the prompt's tokens do, and are cached by their content. Bad tensors
(another hidden size, NaN or inf, too many rows, not a tensor) and a server without the flag get a 400 naming the
problem, and the server serves on."""

from __future__ import annotations

import base64

import httpx
import pytest
import torch
from PIL import Image

from tessera.entrypoints.openai.api_server import ServerThread, build_app
from tessera.multimodal.embeds import encode_image_embeds
from testkit.inputs import image_data_url
from testkit.server import API_KEY

QUESTION = "What colour is the circle?"


def picture() -> Image.Image:
    image = Image.new("RGB", (64, 64), "white")
    image.paste((30, 30, 220), (16, 16, 48, 48))
    return image


@pytest.fixture(scope="module")
def embeds_server(demo_engine):
    with ServerThread(build_app(demo_engine, model_name="demo", enable_mm_embeds=True)) as url:
        yield url, demo_engine


def encoder_output(engine) -> torch.Tensor:
    """What the model's vision tower and projector make of picture(): [image tokens, hidden]."""
    llm_engine = engine.engine
    processed = llm_engine.processor.apply("<image>", {"image": [picture()]})
    model = llm_engine.core.model
    with torch.no_grad():
        (embeds,) = model.get_multimodal_embeddings(**processed["mm_kwargs"])
    return embeds.reshape(-1, embeds.shape[-1])


def chat(url: str, part: dict, headers: dict | None = None) -> httpx.Response:
    messages = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
    body = {"model": "demo", "messages": messages, "max_tokens": 8, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=60)


def test_embeddings_answer_as_the_image_does(embeds_server):
    url, engine = embeds_server
    image_part = {"type": "image_url", "image_url": {"url": image_data_url(picture())}}
    embeds_part = {"type": "image_embeds", "image_embeds": encode_image_embeds(encoder_output(engine))}
    expected = chat(url, image_part).json()["choices"][0]["message"]["content"]
    assert chat(url, embeds_part).json()["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda e: encode_image_embeds(e[:, :-1]), "hidden size"),
        (lambda e: encode_image_embeds(e.clone().fill_(float("nan"))), "NaN"),
        (lambda e: encode_image_embeds(e.repeat(400, 1)), "rows"),
        (lambda e: base64.b64encode(b"not a tensor").decode(), "torch.save"),
        (lambda e: 42, "base64 string"),
    ],
)
def test_bad_embeddings_get_a_400(embeds_server, make, fragment):
    url, engine = embeds_server
    response = chat(url, {"type": "image_embeds", "image_embeds": make(encoder_output(engine))})
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]
    assert chat(url, {"type": "text", "text": "hi"}).status_code == 200


def test_a_server_without_the_flag_refuses_them(server, demo_engine):
    url, _ = server
    part = {"type": "image_embeds", "image_embeds": encode_image_embeds(encoder_output(demo_engine))}
    response = chat(url, part, {"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400 and "--enable-mm-embeds" in response.json()["error"]["message"]


def test_the_offline_chat_takes_them_too(demo_engine):
    from tessera import LLM, TINY_DEMO_MODEL, SamplingParams

    llm = LLM(str(TINY_DEMO_MODEL), kv_cache_memory="16MiB")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    part = {"type": "image_embeds", "image_embeds": encode_image_embeds(encoder_output(demo_engine))}
    with_embeds = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
    with_image = [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture()},
                                               {"type": "text", "text": QUESTION}]}]  # fmt: skip
    (a,), (b,) = llm.chat(with_embeds, params, use_tqdm=False), llm.chat(with_image, params, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt_token_ids == b.prompt_token_ids


# ---- prompt_embeds ---------------------------------------------------------------------------------------------

PROMPT = "USER: How many shapes are there? ASSISTANT:"


def token_embeddings(engine, text: str) -> torch.Tensor:
    """What the model's embedding table gives for the prompt's tokens: [tokens, hidden]."""
    ids = engine.engine.tokenizer.encode(text)
    with torch.no_grad():
        return engine.engine.core.model.get_input_embeddings(torch.tensor(ids))


def test_prompt_embeds_answer_as_their_tokens_do(demo_engine):
    """Offline, in prefill chunks: the embeddings of a prompt's tokens give its tokens' answer; another prompt of the
    same length given as embeddings never hits the first one's cached blocks (their ids are placeholders)."""
    from tessera import LLM, TINY_DEMO_MODEL, SamplingParams

    llm = LLM(str(TINY_DEMO_MODEL), kv_cache_memory="16MiB", max_num_batched_tokens=5, block_size=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    embeds = token_embeddings(demo_engine, PROMPT)
    (by_ids,) = llm.generate(PROMPT, params, use_tqdm=False)
    (by_embeds,) = llm.generate({"prompt_embeds": embeds}, params, use_tqdm=False)
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
    other = token_embeddings(demo_engine, PROMPT.replace("shapes", "circle"))
    assert other.shape == embeds.shape
    hits = llm.engine.core.block_manager.prefix_hits
    (by_other,) = llm.generate({"prompt_embeds": other}, params, use_tqdm=False)
    assert llm.engine.core.block_manager.prefix_hits == hits
    (again,) = llm.generate({"prompt_embeds": embeds}, params, use_tqdm=False)
    assert (
        llm.engine.core.block_manager.prefix_hits > hits and again.outputs[0].token_ids == by_ids.outputs[0].token_ids
    )
    with pytest.raises(ValueError, match="prompt_embeds has shape"):
        llm.generate({"prompt_embeds": embeds[:, :-1]}, params)


def completion(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    body = {"model": "demo", "max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(url + "/v1/completions", json=body, headers=headers or {}, timeout=60)


@pytest.fixture(scope="module")
def prompt_embeds_server(demo_engine):
    with ServerThread(build_app(demo_engine, model_name="demo", enable_prompt_embeds=True)) as url:
        yield url


def test_served_prompt_embeds_answer_as_the_prompt_does(prompt_embeds_server, demo_engine):
    url = prompt_embeds_server
    expected = completion(url, {"prompt": PROMPT}).json()["choices"][0]["text"]
    reply = completion(url, {"prompt_embeds": encode_image_embeds(token_embeddings(demo_engine, PROMPT))})
    assert reply.json()["choices"][0]["text"] == expected


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda e: encode_image_embeds(e[:, :-1]), "hidden size"),
        (lambda e: encode_image_embeds(e.clone().fill_(float("inf"))), "infinite"),
        (lambda e: encode_image_embeds(e.repeat(100, 1)), "rows"),
    ],
)
def test_bad_prompt_embeds_get_a_400(prompt_embeds_server, demo_engine, make, fragment):
    response = completion(prompt_embeds_server, {"prompt_embeds": make(token_embeddings(demo_engine, PROMPT))})
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]
    assert completion(prompt_embeds_server, {"prompt": "hi"}).status_code == 200


def test_prompt_embeds_need_the_flag(server, demo_engine):
    url, _ = server
    body = {"prompt_embeds": encode_image_embeds(token_embeddings(demo_engine, PROMPT))}
    response = completion(url, body, {"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400 and "--enable-prompt-embeds" in response.json()["error"]["message"]


# ---- image_embeds with the metadata a model needs (Qwen2-VL's image_grid_thw) ---------------------------------------

QWEN_PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    """(offline LLM, server URL with --enable-mm-embeds, the tower's embeddings of picture() and their grid)."""
    from tessera import LLM
    from tessera.engine.async_engine import AsyncEngine
    from tessera.engine.llm_engine import LLMEngine
    from testkit.qwen_vl import build_tiny_qwen2_vl

    folder = str(build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl")))
    llm = LLM(folder, kv_cache_memory="8MiB")
    kwargs = llm.engine.processor.apply(QWEN_PROMPT, {"image": [picture()]})["mm_kwargs"]
    with torch.no_grad():
        (embeds,) = llm.engine.core.model.get_multimodal_embeddings(**kwargs)
    grid = kwargs.get_items("image")[0]["image_grid_thw"].data
    engine = AsyncEngine(LLMEngine.from_options(folder, kv_cache_memory="8MiB"))
    try:
        with ServerThread(build_app(engine, model_name="qwen", enable_mm_embeds=True)) as url:
            yield llm, url, embeds, grid
    finally:
        engine.shutdown()


def test_grid_embeddings_answer_as_the_image_does_offline_and_served(qwen2_vl):
    from tessera import SamplingParams

    llm, url, embeds, grid = qwen2_vl
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (by_image,) = llm.generate({"prompt": QWEN_PROMPT, "multi_modal_data": {"image": picture()}}, params)
    data = {"image_embeds": {"image_embeds": embeds, "image_grid_thw": grid}}
    (by_embeds,) = llm.generate({"prompt": QWEN_PROMPT, "multi_modal_data": data}, params)
    assert by_embeds.outputs[0].token_ids == by_image.outputs[0].token_ids  # M-RoPE placed by the grid too
    part = {"type": "image_embeds", "image_embeds": {"image_embeds": encode_image_embeds(embeds),
                                                      "image_grid_thw": encode_image_embeds(grid)}}  # fmt: skip
    messages = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
    url_part = {"type": "image_url", "image_url": {"url": image_data_url(picture())}}
    image_messages = [{"role": "user", "content": [url_part, {"type": "text", "text": QUESTION}]}]
    answers = [
        httpx.post(url + "/v1/chat/completions", json={"messages": m, "max_tokens": 8, "temperature": 0}, timeout=60)
        for m in (messages, image_messages)
    ]
    assert (
        answers[0].json()["choices"][0]["message"]["content"] == answers[1].json()["choices"][0]["message"]["content"]
    )


def test_embeddings_that_their_grid_does_not_size_get_a_400(qwen2_vl):
    _, url, embeds, grid = qwen2_vl
    wrong = grid.clone()
    wrong[1] *= 2
    part = {"type": "image_embeds", "image_embeds": {"image_embeds": encode_image_embeds(embeds),
                                                      "image_grid_thw": encode_image_embeds(wrong)}}  # fmt: skip
    body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and "image_grid_thw" in response.json()["error"]["message"]
