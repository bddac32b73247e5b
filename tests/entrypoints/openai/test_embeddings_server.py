"""/v1/embeddings on a pooling model (the tiny Qwen2-VL, last token, normalized): texts, token ids and a chat with an
image through httpx and the openai client give the offline API's vectors; base64 and dimensions as OpenAI defines
them; bad requests get a 400 naming what is wrong while the server serves on."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from tessera import LLM, PoolingParams
from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.entrypoints.openai.api_server import ServerThread, build_app
from testkit import random_images
from testkit.inputs import image_data_url
from testkit.qwen_vl import build_tiny_qwen2_vl

OPTIONS = {"kv_cache_memory": "8MiB", "runner": "pooling"}
TEXTS = ["A red circle above a blue square", "Three shapes on a white page"]


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory):
    """(base URL, the offline LLM on the same folder)."""
    folder = str(build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl_embedder")))
    engine = AsyncEngine(LLMEngine.from_options(folder, **OPTIONS))
    try:
        with ServerThread(build_app(engine, model_name="tiny-embed")) as url:
            yield url, LLM(folder, **OPTIONS)
    finally:
        engine.shutdown()


def vectors(llm, prompts, params=None):
    return [torch.tensor(o.outputs.embedding) for o in llm.embed(prompts, params, use_tqdm=False)]


def test_texts_through_the_openai_client_are_the_offline_vectors(embedding_server):
    url, llm = embedding_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    reply = client.embeddings.create(model="tiny-embed", input=TEXTS)
    assert [d.index for d in reply.data] == [0, 1] and reply.model == "tiny-embed"
    for item, expected in zip(reply.data, vectors(llm, TEXTS)):
        torch.testing.assert_close(torch.tensor(item.embedding), expected, atol=1e-5, rtol=0)
    ids = llm.get_tokenizer().encode(TEXTS[0])
    assert reply.usage.prompt_tokens == len(ids) + len(llm.get_tokenizer().encode(TEXTS[1]))
    # the client asks for base64 by default when it can decode it: the same floats
    short = client.embeddings.create(model="tiny-embed", input=ids, dimensions=8)
    (expected,) = vectors(llm, [{"prompt_token_ids": ids}], PoolingParams(dimensions=8))
    torch.testing.assert_close(torch.tensor(short.data[0].embedding), expected, atol=1e-5, rtol=0)


def test_a_chat_with_an_image_through_httpx(embedding_server):
    url, llm = embedding_server
    data_url = image_data_url(random_images([(60, 40)], seed=2)[0])
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                             {"type": "text", "text": "A picture"}]}]  # fmt: skip
    body = {"model": "tiny-embed", "messages": messages, "encoding_format": "base64"}
    reply = httpx.post(url + "/v1/embeddings", json=body, timeout=60).json()
    got = torch.from_numpy(np.frombuffer(base64.b64decode(reply["data"][0]["embedding"]), dtype=np.float32).copy())
    prompt = llm.render_chat(messages, add_generation_prompt=False)
    (expected,) = vectors(llm, [prompt])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"input": "hi", "dimensions": 4096}, "dimensions 4096 exceeds"),
        ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, 'exactly one of "input" and "messages"'),
        ({"input": []}, "input is empty"),
        ({"input": "hi", "temperature": 0.5}, "temperature"),
    ],
)
def test_bad_requests_get_a_400_naming_the_problem(embedding_server, body, fragment):
    url, _ = embedding_server
    response = httpx.post(url + "/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]
    assert httpx.post(url + "/v1/embeddings", json={"input": "still here"}, timeout=60).status_code == 200


def test_a_generating_server_refuses_embeddings_by_name(server):
    from testkit.server import API_KEY

    url, _ = server
    response = httpx.post(url + "/v1/embeddings", json={"input": "hi"}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400 and "--runner pooling" in response.json()["error"]["message"]


def test_score_and_rerank_with_an_image_document(embedding_server):
    """/score and /rerank: the offline LLM.score's numbers; rerank orders the documents by them and keeps top_n."""
    url, llm = embedding_server
    picture = image_data_url(random_images([(60, 40)], seed=4)[0])
    parts = [{"type": "image_url", "image_url": {"url": picture}}, {"type": "text", "text": "A page"}]
    query = "Which page shows a circle?"
    documents = [TEXTS[0], {"content": parts}, TEXTS[1]]
    offline = [llm.render_chat([{"role": "user", "content": parts}], add_generation_prompt=False)]
    expected = [o.outputs.score for o in llm.score(query, [TEXTS[0], offline[0], TEXTS[1]], use_tqdm=False)]
    body = {"model": "tiny-embed", "text_1": query, "text_2": documents}
    scores = httpx.post(url + "/score", json=body, timeout=60).json()["data"]
    assert [s["score"] for s in scores] == pytest.approx(expected, abs=1e-5)
    body = {"model": "tiny-embed", "query": query, "documents": documents, "top_n": 2}
    reply = httpx.post(url + "/v1/rerank", json=body, timeout=60).json()
    order = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in reply["results"]] == order
    assert [r["relevance_score"] for r in reply["results"]] == pytest.approx([expected[i] for i in order], abs=1e-5)
    assert reply["results"][0]["document"] == ({"text": documents[order[0]]} if order[0] != 1 else {"content": parts})
