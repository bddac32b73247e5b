"""Int8 weight-only quantization end to end on the tiny LLaVA: logits near the float model's, within a
bound computed from the weights' scales; generation through LLM; the bytes the linears keep."""

from __future__ import annotations

import math

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.layers.linear import Linear
from tessera.testing.generation import greedy_logprobs

PROMPTS = ["USER: Tell me about the sea. ASSISTANT:", "USER: hi ASSISTANT:"]


def make(folder, **options):
    return LLM(str(folder), **{"device": "cpu", "kv_cache_memory": "8MiB", "dtype": "float32", **options})


def linears(llm):
    return {n: m for n, m in llm.engine.model.language_model.named_modules() if isinstance(m, Linear)}


@pytest.fixture(scope="module")
def pair(tiny_llava_dir):
    return make(tiny_llava_dir), make(tiny_llava_dir, quantization="int8")


def test_only_the_language_model_is_quantized(pair):
    dense, quantized = pair
    layers = linears(quantized)
    assert layers and all(m.qweight is not None for m in layers.values())
    assert "lm_head" in layers  # tied or not, lm_head is quantized
    model = quantized.engine.model
    for part in model.multimodal_parts.values():
        assert all(not isinstance(m, Linear) or m.qweight is None for m in getattr(model, part).modules())
    assert all(m.qweight is None for m in linears(dense).values())


def test_linear_weight_bytes_are_a_quarter_of_float32(pair, tiny_llava_dir):
    dense, quantized = pair
    with torch.device("meta"):  # the float model's linears are packed: count their shapes
        meta = type(dense.engine.model)(dense.engine.model_config.hf_config).language_model
    fp32 = sum(m.weight.numel() * 4 for m in meta.modules() if isinstance(m, Linear))
    int8 = sum(m.qweight.numel() + m.qscale.numel() * m.qscale.element_size() for m in linears(quantized).values())
    min_in = min(m.in_features for m in linears(quantized).values())
    assert fp32 / 4 < int8 <= fp32 / 4 * (1 + 4 / min_in)


def test_prefill_logits_stay_within_the_quantization_bound(pair, tiny_llava_dir):
    """Each weight moves by at most scale/2; uniform rounding gives a relative RMS weight error of
    (scale / sqrt(12)) / rms(row) per layer. Errors of the L quantized layers on the path add up to at most
    their sum, so the logits move by ~that sum times their own spread; asserted with a 4x margin."""
    dense, quantized = pair
    vocab = dense.engine.model_config.hf_config.get_text_config().vocab_size
    relative = []
    for layer in linears(quantized).values():
        weight = layer.qweight.double() * layer.qscale.double()[:, None]
        rms = weight.pow(2).mean(dim=1).sqrt()
        relative.append(float((layer.qscale.double() / math.sqrt(12) / rms).mean()))
    predicted = sum(relative)
    ref = greedy_logprobs(dense, PROMPTS, 1, vocab)
    got = greedy_logprobs(quantized, PROMPTS, 1, vocab)
    for (_, expected), (_, actual) in zip(ref, got):
        expected, actual = expected[0], actual[0]  # the prefill's distribution (log-probs: logits up to a shift)
        logits_a, logits_b = expected - expected.mean(), actual - actual.mean()
        error = (logits_b - logits_a).abs()
        spread = float(logits_a.std())
        bound = 4 * predicted * spread
        print(f"max |d logit| {float(error.max()):.2e} mean {float(error.mean()):.2e}; bound {bound:.2e}")
        assert float(error.mean()) <= 4 * predicted * spread
        assert float(error.max()) <= 4 * predicted * spread * 5  # a tail over the vocabulary
        assert error.max() > 0  # the weights did change


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_generation_runs_end_to_end(tiny_llava_dir, dtype):
    llm = make(tiny_llava_dir, dtype=dtype, quantization="int8")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
    assert len(chat.outputs[0].token_ids) == 6


def test_an_unknown_quantization_is_a_clear_error(tiny_llava_dir):
    with pytest.raises(ValueError, match=r"Unsupported quantization 'int3'; supported: int8"):
        make(tiny_llava_dir, quantization="int3")
