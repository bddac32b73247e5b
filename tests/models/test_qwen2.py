"""Qwen2 through the engine: greedy tokens identical to Hugging Face generate alone, batched, with
chunked prefill, prefix caching and preemption (fp32, a tiny random checkpoint built offline)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config
from transformers import Qwen2ForCausalLM as HFQwen2

from tessera import LLM, SamplingParams
from tessera.testing import build_tiny_text_model, build_tokenizer

PROMPTS = ["The circle is red.", "How many squares are there in the picture?", "Describe it.", "A b c d e f g h"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return build_tiny_text_model(tmp_path_factory.mktemp("qwen2"), HFQwen2, Qwen2Config, intermediate_size=48,
                                 rope_theta=1e6)  # fmt: skip


@pytest.fixture(scope="module")
def hf_tokens(qwen2_dir):
    tokenizer = build_tokenizer("llava")
    model = HFQwen2.from_pretrained(qwen2_dir).eval()
    results = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                 eos_token_id=None, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        results.append(out[0, ids.shape[1] :].tolist())
    return results


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(
    "options",
    [{}, {"block_size": 4, "max_num_batched_tokens": 6}, {"block_size": 4, "kv_cache_memory": "12KiB"}],
    ids=["default", "chunked-prefill", "preemption"],
)
def test_qwen2_greedy_matches_hf_alone_and_batched(qwen2_dir, hf_tokens, options):
    llm = LLM(str(qwen2_dir), **{"kv_cache_memory": "8MiB", **options})
    assert [tokens(llm, [p])[0] for p in PROMPTS] == hf_tokens
    assert tokens(llm, PROMPTS) == hf_tokens
    if "kv_cache_memory" in options:
        assert llm.engine.scheduler.num_preemptions > 0


def test_qwen2_prefix_caching_gives_the_same_tokens(qwen2_dir, hf_tokens):
    llm = LLM(str(qwen2_dir), kv_cache_memory="8MiB", block_size=4)
    assert tokens(llm, [PROMPTS[1]]) == [hf_tokens[1]]
    hits = llm.engine.block_manager.prefix_hits
    assert tokens(llm, [PROMPTS[1]]) == [hf_tokens[1]]
    assert llm.engine.block_manager.prefix_hits > hits
