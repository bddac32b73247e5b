"""Weights from a GGUF file (tessera.models.gguf): a tiny Q8_0 Llama written here against what
Hugging Face transformers loads from the same file (`from_pretrained(folder, gguf_file=...)`)."""

from __future__ import annotations

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.config import ModelConfig
from tessera.layers import native_kernels as nk
from tessera.layers.attention import AttentionMetadata, attention_metadata
from tessera.layers.cpu_kernels import DEQUANT, ENV, NATIVE
from tessera.layers.kv_cache import allocate_kv_cache
from tessera.layers.quantization import dequantized_weight
from tessera.models.loader import load_model
from testkit import build_tiny_gguf
from testkit.generation import greedy_logprobs, hf_recomputed_logprobs

pytest.importorskip("gguf", reason="the gguf package writes and reads the test files (pip install gguf)")

MESSAGES = [{"role": "user", "content": "Where is the tower? Paris is"}]


def prefill_logits(model, path):
    """(Tessera's, HF's) logits of 9 random tokens through the model loaded from the GGUF file at `path`."""
    ids = torch.randint(0, 267, (9,), generator=torch.Generator().manual_seed(1))
    allocate_kv_cache(model, num_blocks=4, block_size=4, dtype=torch.float32)
    with torch.no_grad(), attention_metadata(AttentionMetadata.build([9], [9], [[2, 0, 3]], block_size=4)):
        return model.compute_logits(model(ids, torch.arange(9))), hf_model(path)(ids[None]).logits[0]


def hf_model(path):
    pytest.importorskip("accelerate", reason="transformers loads a GGUF model only with accelerate installed")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)


# The weight types llama.cpp users run: K-quants need rows of 256, so those files are wider.
WEIGHT_TYPES = {
    "Q8_0": {}, "F16": {}, "F32": {}, "Q4_0": {}, "Q4_1": {},
    "Q4_K": dict(hidden_size=256, intermediate_size=512), "Q6_K": dict(hidden_size=256, intermediate_size=512),
}  # fmt: skip


@pytest.mark.parametrize(
    "weight_type, tied", [("Q8_0", False)] + [(weight_type, True) for weight_type in WEIGHT_TYPES]
)  # the untied output layer is one more tensor of a type: Q8_0 covers it
def test_prefill_logits_match_hf(tmp_path, tied, weight_type):
    path = build_tiny_gguf(tmp_path / "m.gguf", tie_word_embeddings=tied, weight_type=weight_type,
                           **WEIGHT_TYPES[weight_type])  # fmt: skip
    import gguf

    types = {tensor.tensor_type.name for tensor in gguf.GGUFReader(path).tensors}
    assert weight_type in types  # written as asked, not fallen back
    model = load_model(ModelConfig(str(path), device="cpu"))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ours, expected = prefill_logits(model, path)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_chat_greedy_tokens_and_logprobs_match_hf(tmp_path):
    """The chat prompt from the file's template, then 10 greedy steps: the same tokens as HF's
    generate and the same distribution at each step (HF recomputes without a cache)."""
    path = build_tiny_gguf(tmp_path / "m.gguf")
    hf = hf_model(path)
    hf.generation_config.eos_token_id = None  # as ignore_eos: ten steps whatever comes
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    inputs = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    expected = hf.generate(**inputs, max_new_tokens=10, do_sample=False)[0, inputs["input_ids"].shape[1] :]

    llm = LLM(str(path), kv_cache_memory="16MiB", device="cpu")
    prompt = llm.render_chat(MESSAGES)
    assert llm.get_tokenizer().encode(prompt["prompt"]) == inputs["input_ids"][0].tolist()
    ((tokens, logprobs),) = greedy_logprobs(llm, [prompt], max_tokens=10, vocab_size=267)
    assert tokens == expected.tolist()
    torch.testing.assert_close(logprobs, hf_recomputed_logprobs(hf, inputs, tokens), atol=1e-4, rtol=0)


def test_a_folder_holding_one_gguf_file_is_a_model(tmp_path):
    path = build_tiny_gguf(tmp_path / "model" / "tiny.Q8_0.gguf")
    by_folder, by_file = LLM(str(path.parent), kv_cache_memory="16MiB"), LLM(str(path), kv_cache_memory="16MiB")
    prompt = by_file.render_chat(MESSAGES)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert by_folder.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == (
        by_file.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    )


def test_tensors_the_conversion_cannot_place_are_an_error(tmp_path):
    """transformers skips them silently; loading them nowhere would run a different model."""
    path = build_tiny_gguf(tmp_path / "m.gguf", extra_tensors=("blk.0.mystery.weight",))
    with pytest.raises(ValueError, match=r"gives no place in LlamaForCausalLM: blk\.0\.mystery\.weight"):
        load_model(ModelConfig(str(path), device="cpu"))


def test_llama_cpp_rope_factors_are_recomputed_not_loaded(tmp_path):
    path = build_tiny_gguf(tmp_path / "m.gguf", extra_tensors=("rope_freqs.weight",))
    load_model(ModelConfig(str(path), device="cpu"))


KEPT_AS = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4", "Q5_0": "int8", "Q5_1": "int8", "Q4_K": "int4",
           "Q6_K": "int8"}  # fmt: skip


@pytest.mark.parametrize("weight_type", list(KEPT_AS))
def test_quantization_auto_keeps_the_files_blocks(tmp_path, monkeypatch, weight_type):
    """quantization="auto" runs a GGUF file's blocks as they are (`layers.gguf_blocks`): every layer's weights are
    exactly those HF de-quantizes from the file (Llama's q / k rows in HF's order), and the logits those of HF but
    for x's int16 rounding in the native kernels (at most 2^-16 of its group's largest |x| an element, ~15
    linears deep: 1e-3 of the logits' range bounds it)."""
    path = build_tiny_gguf(tmp_path / "m.gguf", weight_type=weight_type, **WEIGHT_TYPES.get(weight_type, {}))
    monkeypatch.delenv(ENV, raising=False)
    model = load_model(ModelConfig(str(path), device="cpu", quantization="auto"))
    dense = load_model(ModelConfig(str(path), device="cpu"))  # HF's de-quantized weights (the test above)
    layers = {n: m for n, m in model.named_modules() if getattr(m, "quantization", None) is not None}
    assert len(layers) == 2 * 4 + 1  # qkv, o, gate_up, down; lm_head
    for name, layer in layers.items():
        if nk.available():
            assert (layer.quantization, layer.quant_kernel) == (KEPT_AS[weight_type], NATIVE), name
            assert torch.equal(dequantized_weight(layer), dense.get_submodule(name).weight.double()), name
    ours, expected = prefill_logits(model, path)
    assert (ours - expected).abs().max() <= 1e-3 * (expected.max() - expected.min())
    monkeypatch.setenv(ENV, "fallback")  # no native kernels: re-quantized from the de-quantized weights
    fallback = load_model(ModelConfig(str(path), device="cpu", quantization="auto"))
    assert {m.quant_kernel for m in fallback.modules() if getattr(m, "quantization", None)} == {DEQUANT}


def test_a_layer_fusing_tensors_of_two_types_keeps_both(tmp_path, monkeypatch):
    """llama.cpp's mixes (Q4_K_M) give attn_v and ffn_down more bits: q | k | v of Q4_K and Q6_K become one int8
    layer with groups of 16 and float32 scales, every weight still the file's."""
    if not nk.available():
        pytest.skip("the native kernels are not built here")
    monkeypatch.delenv(ENV, raising=False)
    path = build_tiny_gguf(tmp_path / "m.gguf", weight_type="Q4_K", weight_types={"attn_v": "Q6_K"},
                           hidden_size=256, intermediate_size=512)  # fmt: skip
    model = load_model(ModelConfig(str(path), device="cpu", quantization="auto"))
    dense = load_model(ModelConfig(str(path), device="cpu"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.quantization == "int8" and qkv.qscale.dtype == torch.float32 and qkv.qscale.shape[1] == 256 // 16
    assert model.model.layers[0].mlp.gate_up_proj.quantization == "int4"
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"):
        assert torch.equal(dequantized_weight(model.get_submodule(name)), dense.get_submodule(name).weight.double())
