"""The pooling runner (`LLM(model, runner="pooling")`, `LLM.embed`) against HF transformers on a tiny Qwen2-VL
saved as a sentence-transformers embedder (last token, normalized): a text prompt and an image+text prompt give
HF's normalized last hidden state (fp32, 1e-4), batched, in prefill chunks and from the prefix cache; a MEAN pooler
gives HF's mean; no KV block stays behind; each runner refuses the other's requests by name."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

from tessera import LLM, PoolingParams, SamplingParams
from tessera.errors import InputError
from testkit import random_images
from testkit.qwen_vl import build_tiny_qwen2_vl

IMAGE_PROMPT = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>A picture of a red circle<|im_end|>\n"
TEXT_PROMPT = "<|im_start|>user\nA red circle above a blue square<|im_end|>\n"


def prompts():
    return [{"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": random_images([(60, 40)], seed=1)}}, TEXT_PROMPT]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """(folder, HF's final hidden states [tokens, hidden] per prompt): the model saved with sentence-transformers'
    modules.json (Transformer, Pooling by the last token, Normalize)."""
    folder = build_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl_embedder"))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    hf_model = Qwen2VLForConditionalGeneration.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    hidden = []
    with torch.no_grad():
        for p in prompts():
            images = p["multi_modal_data"]["image"] if isinstance(p, dict) else None
            inputs = processor(text=p["prompt"] if images else p, images=images, return_tensors="pt")
            hidden.append(hf_model.model(**inputs).last_hidden_state[0])
    return folder, hidden


@pytest.mark.parametrize("case", ["batched", "chunked-prefill", "prefix-caching"])
def test_embeddings_are_hfs_normalized_last_hidden_states(embedder, case):
    folder, hidden = embedder
    options = {"chunked-prefill": {"max_num_batched_tokens": 5}, "prefix-caching": {"block_size": 4}}.get(case, {})
    llm = LLM(str(folder), runner="pooling", **{"kv_cache_memory": "8MiB", **options})
    for _ in range(2 if case == "prefix-caching" else 1):  # the second time from cached blocks
        outputs = llm.embed(prompts(), use_tqdm=False)
        for output, states in zip(outputs, hidden):
            torch.testing.assert_close(torch.tensor(output.outputs.embedding), F.normalize(states[-1], dim=-1),
                                       atol=1e-4, rtol=0)  # fmt: skip
    assert not llm.engine.core.block_manager.req_blocks  # pooled requests keep no KV blocks
    if case == "prefix-caching":
        assert llm.engine.core.block_manager.prefix_hits > 0


def test_a_mean_pooler_with_matryoshka_dimensions(embedder):
    folder, hidden = embedder
    llm = LLM(str(folder), runner="pooling", pooler_config={"pooling_type": "MEAN", "normalize": True},
              kv_cache_memory="8MiB", max_num_batched_tokens=6)  # fmt: skip
    assert not llm.engine.core.cache_config.enable_prefix_caching  # every token's state is needed
    outputs = llm.embed(prompts(), PoolingParams(dimensions=8), use_tqdm=False)
    for output, states in zip(outputs, hidden):
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), F.normalize(states.mean(0)[:8], dim=-1),
                                   atol=1e-4, rtol=0)  # fmt: skip


def test_each_runner_refuses_the_others_requests_by_name(embedder):
    folder, _ = embedder
    pooling = LLM(str(folder), runner="pooling", kv_cache_memory="8MiB")
    with pytest.raises(InputError, match="runner='pooling'.*does not generate"):
        pooling.generate(TEXT_PROMPT, SamplingParams(max_tokens=2))
    with pytest.raises(InputError, match="dimensions 4096 exceeds"):
        pooling.embed(TEXT_PROMPT, PoolingParams(dimensions=4096))
    assert len(pooling.embed(TEXT_PROMPT, use_tqdm=False)[0].outputs.embedding) == 32  # hidden size; serving on
    generating = LLM(str(folder), kv_cache_memory="8MiB")
    with pytest.raises(InputError, match="runner='pooling'"):
        generating.embed(TEXT_PROMPT)


def test_score_is_the_cosine_of_hfs_embeddings(embedder):
    """`LLM.score`: one query against an image document and a text document, each the cosine of HF's pooled
    states; queries and documents paired one to one too."""
    folder, hidden = embedder
    llm = LLM(str(folder), runner="pooling", kv_cache_memory="8MiB")
    query = "<|im_start|>user\nWhich shows a red circle?<|im_end|>\n"
    (query_vector,) = [torch.tensor(e.outputs.embedding) for e in llm.embed([query], use_tqdm=False)]
    scores = [o.outputs.score for o in llm.score(query, prompts(), use_tqdm=False)]
    expected = [float(F.cosine_similarity(query_vector, states[-1], dim=0)) for states in hidden]
    assert scores == pytest.approx(expected, abs=1e-4)
    paired = [o.outputs.score for o in llm.score([query, query], prompts(), use_tqdm=False)]
    assert paired == pytest.approx(expected, abs=1e-4)
    with pytest.raises(ValueError, match="one to one"):
        llm.score([query, query], [TEXT_PROMPT, TEXT_PROMPT, TEXT_PROMPT])
