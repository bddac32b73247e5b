"""ColQwen2 (multi-vector retrieval) against Hugging Face transformers on a tiny checkpoint (fp32): ids as
ColQwen2Processor's process_images / process_queries give them, every token's embedding (1e-4) for document images
and queries, alone, batched and in prefill chunks, and LLM.score = HF's score_retrieval (MaxSim); it only pools."""

from __future__ import annotations

import pytest
import torch
from transformers import ColQwen2ForRetrieval as HFColQwen2
from transformers import ColQwen2Processor

from tessera import LLM, SamplingParams
from tessera.errors import InputError
from testkit import random_images
from testkit.colqwen2 import EMBEDDING_DIM, build_tiny_colqwen2
from testkit.inputs import image_data_url

QUERIES = ["a red circle", "two blue squares on a page"]


def pages():
    return random_images([(60, 40), (40, 70)], seed=5)


@pytest.fixture(scope="module")
def colqwen2(tmp_path_factory):
    """(folder, HF processor outputs and embeddings for the pages, then for the queries)."""
    folder = build_tiny_colqwen2(tmp_path_factory.mktemp("colqwen2"))
    hf_model = HFColQwen2.from_pretrained(folder).eval()
    processor = ColQwen2Processor.from_pretrained(folder)
    expected = []
    with torch.no_grad():
        for page in pages():
            inputs = processor.process_images(images=[page])
            expected.append((inputs["input_ids"][0].tolist(), hf_model(**inputs).embeddings[0]))
        for query in QUERIES:
            inputs = processor.process_queries(text=[query])
            expected.append((inputs["input_ids"][0].tolist(), hf_model(**inputs).embeddings[0]))
    return folder, processor, expected


def requests():
    return [{"prompt": "", "multi_modal_data": {"image": page}} for page in pages()] + QUERIES


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 6}], ids=["batched", "chunked-prefill"])
def test_token_embeddings_match_hf(colqwen2, options):
    folder, _, expected = colqwen2
    llm = LLM(str(folder), kv_cache_memory="8MiB", **options)
    assert llm.engine.model_config.runner == "pooling"  # a retrieval architecture pools by default
    for output, (ids, embeddings) in zip(llm.embed(requests(), use_tqdm=False), expected):
        assert output.prompt_token_ids == ids
        got = torch.tensor(output.outputs.embedding)
        assert got.shape == (len(ids), EMBEDDING_DIM)
        torch.testing.assert_close(got, embeddings, atol=1e-4, rtol=0)
    alone = llm.embed(requests()[2], use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(alone.outputs.embedding), expected[2][1], atol=1e-4, rtol=0)


def test_scores_are_hfs_late_interaction(colqwen2):
    folder, processor, expected = colqwen2
    llm = LLM(str(folder), kv_cache_memory="8MiB")
    page_vectors, query_vectors = [e for _, e in expected[:2]], [e for _, e in expected[2:]]
    hf_scores = processor.score_retrieval(query_vectors, page_vectors)  # [queries, pages]
    for q, query in enumerate(QUERIES):
        scores = [o.outputs.score for o in llm.score(query, requests()[:2], use_tqdm=False)]
        assert scores == pytest.approx(hf_scores[q].tolist(), rel=1e-4)


def test_it_only_pools(colqwen2):
    folder, _, _ = colqwen2
    with pytest.raises(ValueError, match="runner='pooling' only"):
        LLM(str(folder), kv_cache_memory="8MiB", runner="generate")
    llm = LLM(str(folder), kv_cache_memory="8MiB")
    with pytest.raises(InputError, match="does not generate"):
        llm.generate(QUERIES[0], SamplingParams(max_tokens=2))


def test_rerank_over_http_gives_the_offline_scores(colqwen2):
    """/rerank with page images as documents (content parts; ColQwen2 writes its visual prompt over the text)."""
    import httpx

    from tessera.engine.async_engine import AsyncEngine
    from tessera.engine.llm_engine import LLMEngine
    from tessera.entrypoints.openai.api_server import ServerThread, build_app

    folder, _, _ = colqwen2
    documents = [{"content": [{"type": "image_url", "image_url": {"url": image_data_url(page)}}]} for page in pages()]
    expected = [o.outputs.score for o in LLM(str(folder), kv_cache_memory="8MiB").score(QUERIES[0], requests()[:2])]
    engine = AsyncEngine(LLMEngine.from_options(str(folder), kv_cache_memory="8MiB"))
    try:
        with ServerThread(build_app(engine, model_name="colqwen2")) as base:
            body = {"query": QUERIES[0], "documents": documents, "return_documents": False}
            reply = httpx.post(base + "/rerank", json=body, timeout=60).json()
    finally:
        engine.shutdown()
    order = sorted(range(2), key=lambda i: -expected[i])
    assert [r["index"] for r in reply["results"]] == order
    assert [r["relevance_score"] for r in reply["results"]] == pytest.approx([expected[i] for i in order], rel=1e-4)
