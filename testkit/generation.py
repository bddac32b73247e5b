"""Greedy generation through the engine with the whole next-token distribution at every step, for
tests that compare the model code with Hugging Face transformers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tessera.sampling_params import SamplingParams


def greedy_logprobs(
    llm: Any, prompts: Sequence[Any], max_tokens: int, vocab_size: int
) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt (all sent in one `llm.generate` call, so the engine batches them): the greedy
    token ids (end-of-sequence ignored) and the log-probabilities of every token at each step,
    [max_tokens, vocab_size]; row 0 is the distribution after the prompt's last token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=vocab_size)
    results = []
    for output in llm.generate(list(prompts), params, use_tqdm=False):
        (completion,) = output.outputs
        steps = [[step[token] for token in range(vocab_size)] for step in completion.logprobs]
        results.append((completion.token_ids, torch.tensor(steps)))
    return results


def hf_recomputed_logprobs(hf_model: Any, inputs: Any, tokens: Sequence[int]) -> torch.Tensor:
    """HF's log-probabilities after the prompt and after each generated token but the last, from one
    forward over prompt + tokens (no KV cache): [len(tokens), vocab]. `inputs`: the HF processor's."""
    inputs = dict(inputs)
    prompt_len = inputs["input_ids"].shape[1]
    inputs["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([list(tokens[:-1])])], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    with torch.no_grad():
        return hf_model(**inputs).logits[0, prompt_len - 1 :].log_softmax(-1)


def hf_greedy_tokens(hf_model: Any, tokenizer: Any, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """HF `generate`'s greedy tokens for each text prompt alone (end-of-sequence ignored)."""
    results = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        results.append(out[0, ids.shape[1] :].tolist())
    return results


ENGINE_CASES = ("default", "chunked-prefill", "prefix-caching", "preemption")
"""The engine settings a model's greedy tokens are checked under (`engine_case_options`)."""


def kv_bytes_per_token(text_config: Any, dtype_bytes: int = 4) -> int:
    """KV-cache bytes one token takes across the layers of a (HF) text config; for Gemma 4 each layer's own
    geometry (`per_layer_config`), layers that reuse another's cache (`kv_sharing_modes`) holding none."""
    modes = getattr(text_config, "kv_sharing_modes", None)
    if modes is not None:
        layers = [text_config.per_layer_config[i] for i, mode in enumerate(modes) if mode != "reuse"]
        return sum(2 * layer.num_key_value_heads * layer.head_dim * dtype_bytes for layer in layers)
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return text_config.num_hidden_layers * 2 * text_config.num_key_value_heads * head_dim * dtype_bytes


def engine_case_options(
    case: str, *, text_config: Any, prompt_lens: Sequence[int], chunk: int, block_size: int = 4
) -> dict[str, Any]:
    """LLM options for one of ENGINE_CASES: no prefix caching but in "prefix-caching"; prefill chunks of
    `chunk` tokens; for "preemption" a KV cache of exactly the blocks the prompts fill when they start
    together, so the first decoding block preempts one of them."""
    blocks = sum(-(-n // block_size) for n in prompt_lens)
    return {
        "default": {"enable_prefix_caching": False},
        "chunked-prefill": {"max_num_batched_tokens": chunk, "enable_prefix_caching": False},
        "prefix-caching": {},
        "preemption": {
            "kv_cache_memory": blocks * block_size * kv_bytes_per_token(text_config),
            "enable_prefix_caching": False,
        },
    }[case]


def assert_chunk_boundary_inside_an_item(llm: Any, request: dict, modality: str, chunk: int) -> None:
    """A prefill chunk boundary (every `chunk` tokens) falls inside the first `modality` item of `request`."""
    out = llm.engine.processor.apply(request["prompt"], request["multi_modal_data"])
    placeholder = out["mm_placeholders"][modality][0]
    boundaries = range(0, len(out["prompt_token_ids"]), chunk)
    assert any(placeholder.offset < b < placeholder.offset + placeholder.length for b in boundaries)


def assert_engine_case_happened(llm: Any, case: str, prefix_hits_before: int) -> None:
    """The case did what it is for: "prefix-caching" hit cached blocks, "preemption" preempted."""
    if case == "prefix-caching":
        assert llm.engine.core.block_manager.prefix_hits > prefix_hits_before
    if case == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0
