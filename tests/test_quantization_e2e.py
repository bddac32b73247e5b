"""Weight-only quantization (int8, int4) end to end on the tiny LLaVA: logits near the float model's, within
a bound computed from the weights' scales; generation through LLM; the bytes the linears keep; int4's
de-quantizing fallback against its op."""

from __future__ import annotations

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.layers.cpu_kernels import DEQUANT, ENV, NATIVE
from tessera.layers.int4_kernels import INT4_MM
from tessera.layers.linear import Linear
from tessera.layers.quantization import dequantized_weight, quantized_values
from testkit.generation import greedy_logprobs

PROMPTS = ["USER: Tell me about the sea. ASSISTANT:", "USER: hi ASSISTANT:"]
METHODS = ["int8", "int4"]


def make(folder, **options):
    return LLM(str(folder), **{"device": "cpu", "kv_cache_memory": "8MiB", "dtype": "float32", **options})


def linears(llm):
    return {n: m for n, m in llm.engine.core.model.language_model.named_modules() if isinstance(m, Linear)}


def dequantized_and_step(layer: Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized layer's weight [out, in] (float64) and the rounding step of each of its entries (its group's
    scale)."""
    scale = quantized_values(layer)[1].double()
    return dequantized_weight(layer), scale.repeat_interleave(layer.in_features // scale.shape[1], dim=1)


def stored_rows(layer: Linear) -> int:
    """The output rows a quantized layer stores: padded to 16k for the native kernels and torch's int4 op."""
    return -(-layer.out_features // 16) * 16 if layer.quant_kernel in (NATIVE, INT4_MM) else layer.out_features


@pytest.fixture(scope="module")
def dense(tiny_llava_dir):
    return make(tiny_llava_dir)


@pytest.fixture(scope="module", params=METHODS)
def quantized(request, tiny_llava_dir):
    return make(tiny_llava_dir, quantization=request.param)


def test_only_the_language_model_is_quantized(dense, quantized):
    method = quantized.engine.model_config.quantization
    layers = linears(quantized)
    assert layers and all(m.qweight is not None and m.quantization == method for m in layers.values())
    assert "lm_head" in layers  # tied or not, lm_head is quantized
    embedding = quantized.engine.core.model.language_model.model.embed_tokens.weight
    assert all(m.weight.numel() == 0 or m.weight is embedding for m in layers.values())  # float weights dropped
    model = quantized.engine.core.model
    for part in model.multimodal_parts.values():
        assert all(not isinstance(m, Linear) or m.qweight is None for m in getattr(model, part).modules())
    assert all(m.qweight is None for m in linears(dense).values())


def test_linear_weight_bytes(dense, quantized):
    """int8: a byte a weight plus a float32 scale per group of 32 (9/32 of float32); int4: half a byte plus a
    float32 scale and zero per group (3/16), every in_features here being a multiple of 32, of out_features
    padded to 16k for the native kernels and torch's int4 op (lm_head: 514 -> 528)."""
    with torch.device("meta"):  # the float model's linears are packed: count their shapes
        meta = type(dense.engine.core.model)(dense.engine.model_config.hf_config).language_model
    fp32 = sum(m.weight.numel() * 4 for m in meta.modules() if isinstance(m, Linear))
    layers = linears(quantized).values()
    kept = sum(
        m.qweight.numel() * m.qweight.element_size() + m.qscale.numel() * m.qscale.element_size() for m in layers
    )
    padded = sum(stored_rows(m) * m.in_features * 4 for m in layers)
    ratio = {"int8": (9, 32), "int4": (3, 16)}[quantized.engine.model_config.quantization]
    assert kept == padded * ratio[0] // ratio[1] and fp32 * ratio[0] // ratio[1] <= kept


def test_prefill_logits_stay_within_the_quantization_bound(dense, quantized):
    """Each weight moves by at most step/2 (int8: the row's scale, int4: its group's); uniform rounding gives
    a relative RMS weight error of sqrt(mean step^2 / 12) / rms(row) per layer. Errors of the L quantized
    layers on the path add up to at most their sum, so the logits move by ~that sum times their own spread;
    asserted with a 4x margin."""
    vocab = dense.engine.model_config.hf_config.get_text_config().vocab_size
    relative = []
    for layer in linears(quantized).values():
        weight, step = dequantized_and_step(layer)
        rms = weight.pow(2).mean(dim=1).sqrt()
        relative.append(float((step.pow(2).mean(dim=1).div(12).sqrt() / rms).mean()))
    predicted = sum(relative)
    ref = greedy_logprobs(dense, PROMPTS, 1, vocab)
    got = greedy_logprobs(quantized, PROMPTS, 1, vocab)
    for (_, expected), (_, actual) in zip(ref, got):
        expected, actual = expected[0], actual[0]  # the prefill's distribution (log-probs: logits up to a shift)
        logits_a, logits_b = expected - expected.mean(), actual - actual.mean()
        error = (logits_b - logits_a).abs()
        spread = float(logits_a.std())
        print(f"predicted {predicted:.3f}: max |d logit| {float(error.max()):.2e}, mean {float(error.mean()):.2e}")
        assert float(error.mean()) <= 4 * predicted * spread
        assert float(error.max()) <= 4 * predicted * spread * 5  # a tail over the vocabulary
        assert error.max() > 0  # the weights did change


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_generation_runs_end_to_end(tiny_llava_dir, method, dtype):
    llm = make(tiny_llava_dir, dtype=dtype, quantization=method)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
    assert len(chat.outputs[0].token_ids) == 6


@pytest.mark.parametrize("method", METHODS)
def test_the_native_kernels_give_the_logits_of_the_fallback(tiny_llava_dir, monkeypatch, method):
    """Same quantized weights; the native kernels (auto) and the de-quantized matmul (fallback) differ only in
    the order of float32 sums and the native kernels' int16 x (an error of at most 2^-16 of a group's largest
    |x| an element): each linear's output moves by at most 1.5e-5 of its sum of |terms|, and 15 linears (2
    layers of 7, the lm_head) add at most ~2.3e-4; 5e-4 of the log-probs' spread bounds it (seen: ~1e-4)."""
    monkeypatch.delenv(ENV, raising=False)
    auto = make(tiny_llava_dir, quantization=method)
    monkeypatch.setenv(ENV, "fallback")
    fallback = make(tiny_llava_dir, quantization=method)
    assert all(m.quant_kernel == DEQUANT for m in linears(fallback).values())
    assert all(m.quant_kernel == NATIVE for m in linears(auto).values())
    vocab = auto.engine.model_config.hf_config.get_text_config().vocab_size
    for prompt in PROMPTS:
        ((ids_a, a),), ((ids_b, b),) = (greedy_logprobs(llm, [prompt], 4, vocab) for llm in (auto, fallback))
        assert ids_a == ids_b
        error, spread = float((a - b).abs().max()), float(a.std())
        print(f"max |d logprob| {error:.2e}, spread {spread:.2f}")
        assert error <= 5e-4 * spread


def test_an_unknown_quantization_is_a_clear_error(tiny_llava_dir):
    with pytest.raises(ValueError, match=r"Unsupported quantization 'int3'; supported: int8, int4"):
        make(tiny_llava_dir, quantization="int3")
