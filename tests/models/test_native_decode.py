"""The native decode layer (models/native_decode.py, layers/csrc/decode_layer.cpp) computes the eager layer's
numbers with its roundings, up to the order of float32 sums (RMSNorm, attention): the same greedy tokens and
log-probabilities within float32 (16-bit: one ulp) rounding of the eager path's, for each Llama-shaped family
(Llama under LLaVA, Qwen2's q/k/v biases, Qwen3's q/k norms, sliding windows, Gemma 3's four (1 + w) norms and
two rotary tables), dtype and weight kind, for one
sequence and several of different lengths. HF parity of the same models (test_text_backbones.py,
test_llava.py ...) runs through it too."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tessera import LLM
from tessera.layers import native_kernels
from tessera.layers.cpu_kernels import ENV
from tessera.models.gemma3 import Gemma3DecoderLayer
from tessera.models.llama import LlamaDecoderLayer
from testkit import build_tiny_text_model
from testkit.generation import greedy_logprobs

PROMPTS = ["USER: Tell me about the sea. ASSISTANT:", "one two three", "A b c d e f g h i j k l m n"]
TEXT_MODELS = {
    "qwen2-bias": (Qwen2ForCausalLM, Qwen2Config, dict(rope_theta=1e6)),
    "qwen3-norms-window": (
        Qwen3ForCausalLM, Qwen3Config, dict(head_dim=16, use_sliding_window=True, sliding_window=6, max_window_layers=0)
    ),
    "mistral-window": (MistralForCausalLM, MistralConfig, dict(sliding_window=4)),
    "gemma3": (
        Gemma3ForCausalLM, Gemma3TextConfig, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                                  layer_types=["sliding_attention", "full_attention"])
    ),
}  # fmt: skip


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    """These tests are about the native layer: they run it whatever $TESSERA_CPU_KERNELS the suite runs with."""
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_llava_dir):
    built = {"llava": tiny_llava_dir}
    for name, (model_cls, config_cls, overrides) in TEXT_MODELS.items():
        built[name] = build_tiny_text_model(tmp_path_factory.mktemp(name), model_cls, config_cls, **overrides)
    return built


def decoder_layers(llm) -> list[LlamaDecoderLayer | Gemma3DecoderLayer]:
    return [m for m in llm.engine.core.model.modules() if isinstance(m, (LlamaDecoderLayer, Gemma3DecoderLayer))]


def native_and_eager(llm, prompts, vocab):
    """The greedy log-probs with the native layers, then with every layer forced eager."""
    native = greedy_logprobs(llm, prompts, 5, vocab)
    layers = decoder_layers(llm)
    assert layers and all(layer._native for layer in layers), "every layer ran natively"
    for layer in layers:
        layer._native = False
    return native, greedy_logprobs(llm, prompts, 5, vocab)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("name", ["llava", *TEXT_MODELS])
def test_the_native_layer_gives_the_eager_layers_numbers(folders, name, kind):
    options = dict(dtype="bfloat16" if kind != "float32" else "float32")
    if kind in ("int8", "int4"):
        options["quantization"] = kind
    llm = LLM(str(folders[name]), device="cpu", kv_cache_memory="8MiB", enable_prefix_caching=False, **options)
    vocab = llm.engine.model_config.hf_config.get_text_config().vocab_size
    for prompts in (PROMPTS, PROMPTS[:1]):  # several sequences (a mask), one (its visible keys sliced)
        for layer in decoder_layers(llm):
            layer._native = None  # built again on the next decode step
        native, eager = native_and_eager(llm, prompts, vocab)
        for (ids_a, a), (ids_b, b) in zip(native, eager):
            assert torch.equal(a[0], b[0])  # the prefill's distribution: eager either way
            # float32: only the order of float32 sums differs (RMSNorm's, attention's): seen 5e-7 of log-probs of
            # ~6; 16-bit: a value an ulp apart (2^-8) somewhere in a layer, seen 2e-3
            tolerance = (1e-5 if kind == "float32" else 2**-8) * float(b.abs().max())
            assert_same_greedy_run(ids_a, a, ids_b, b, tolerance)


def assert_same_greedy_run(ids_a, a, ids_b, b, tolerance):
    """The same tokens with log-probs within `tolerance`, up to a step where the reference (b) itself nearly ties
    (its two choices within `tolerance`): there an ulp decides, and the runs may part. In 16 bits an ulp does
    move Gemma 3's outputs: its norms after the attention and the MLP scale their outputs up to the residual's
    size, so an attention output one ulp apart (float32 sums in another order) shows in the layer's output."""
    steps = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), len(ids_b))
    assert float((a[:steps + 1] - b[:steps + 1]).abs().max()) <= tolerance
    if steps < len(ids_b):
        assert float(b[steps, ids_b[steps]] - b[steps, ids_a[steps]]) <= tolerance, "parted where b does not tie"


def test_fallback_stays_eager(folders, monkeypatch):
    assert native_kernels.available()
    monkeypatch.setenv(ENV, "fallback")
    llm = LLM(str(folders["llava"]), device="cpu", kv_cache_memory="8MiB")
    llm.generate(PROMPTS, use_tqdm=False)
    assert all(layer._native is False for layer in decoder_layers(llm))


@pytest.mark.parametrize("weight_types", [{}, {"attn_v": "Q6_K"}], ids=["Q4_K", "Q4_K+Q6_K"])
def test_a_gguf_files_blocks_run_natively_with_the_eager_numbers(tmp_path, weight_types):
    """quantization="auto" keeps a GGUF file's blocks: int4 with zero point 0 (Q4_K), int8 with zeros (q | k | v
    of Q4_K and Q6_K); the native layer calls those kernels as the eager linears do."""
    pytest.importorskip("gguf", reason="the gguf package writes the test file")
    from testkit import build_tiny_gguf

    path = build_tiny_gguf(tmp_path / "m.gguf", weight_type="Q4_K", weight_types=weight_types, hidden_size=256,
                           intermediate_size=512)  # fmt: skip
    llm = LLM(str(path), device="cpu", dtype="bfloat16", quantization="auto", kv_cache_memory="8MiB",
              enable_prefix_caching=False)  # fmt: skip
    qkv = decoder_layers(llm)[0].self_attn.qkv_proj
    assert (qkv.quantization, qkv.qzero_point) == (("int8", 8) if weight_types else ("int4", 0))
    vocab = llm.engine.model_config.hf_config.vocab_size
    native, eager = native_and_eager(llm, PROMPTS, vocab)
    for (ids_a, a), (ids_b, b) in zip(native, eager):
        assert_same_greedy_run(ids_a, a, ids_b, b, 2**-8 * float(b.abs().max()))


def test_tensor_parallel_ranks_run_the_native_layer_in_three_parts(folders):
    """Two ranks: each layer's native parts with the o and down outputs summed over the ranks between them; rank 0's
    layers (this process) ran natively, and give the numbers of its eager layers."""
    llm = LLM(str(folders["qwen2-bias"]), device="cpu", dtype="float32", tensor_parallel_size=2,
              kv_cache_memory="8MiB", enable_prefix_caching=False)  # fmt: skip
    try:
        vocab = llm.engine.model_config.hf_config.vocab_size
        native = greedy_logprobs(llm, PROMPTS, 5, vocab)
        layers = decoder_layers(llm)
        assert layers and all(layer._native and layer._native.tp.world_size == 2 for layer in layers)
        for layer in layers:
            layer._native = False
        eager = greedy_logprobs(llm, PROMPTS, 5, vocab)
    finally:
        llm.shutdown()
    for (ids_a, a), (ids_b, b) in zip(native, eager):
        assert_same_greedy_run(ids_a, a, ids_b, b, 1e-5 * float(b.abs().max()))
