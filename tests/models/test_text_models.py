"""The text backbones (Llama, Persimmon, Qwen2, Mistral, Qwen3, Gemma 3) against Hugging Face
transformers' eager attention, prefill logits in fp32; windowed configs with prompts longer than
the window."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PersimmonConfig,
    Qwen2Config,
    Qwen3Config,
)

from tessera import ModelRegistry
from tessera.config import ModelConfig
from tessera.layers.attention import AttentionMetadata, attention_metadata
from tessera.layers.kv_cache import allocate_kv_cache
from tessera.models.loader import load_model

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
GEMMA3 = dict(TINY, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=12,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=4)  # fmt: skip
WINDOW = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)  # layer 0 full, layer 1 windowed
PROMPT_LEN = 11

CASES = {
    "llama-gqa": LlamaConfig(**TINY, num_key_value_heads=2),
    "llama-tied-linear-rope": LlamaConfig(
        **TINY, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
    "persimmon": PersimmonConfig(**TINY),
    "qwen2-gqa": Qwen2Config(**TINY, num_key_value_heads=2, rope_theta=1e6),
    "qwen2-tied-mqa": Qwen2Config(**TINY, num_key_value_heads=1, tie_word_embeddings=True),
    "qwen2-window": Qwen2Config(**TINY, num_key_value_heads=2, **WINDOW),
    "mistral-window": MistralConfig(**TINY, num_key_value_heads=2, sliding_window=4),
    "mistral-no-window": MistralConfig(**TINY, num_key_value_heads=2, sliding_window=None),
    "qwen3-head-dim": Qwen3Config(**TINY, num_key_value_heads=2, head_dim=16),
    "qwen3-bias-window": Qwen3Config(**TINY, num_key_value_heads=2, head_dim=8, attention_bias=True, **WINDOW),
    "gemma3": Gemma3TextConfig(**GEMMA3),
    "gemma3-softcap-linear-rope": Gemma3TextConfig(
        **GEMMA3,
        final_logit_softcapping=0.1,
        attn_logit_softcapping=0.5,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "linear", "factor": 8.0},  # the global (full-attention) rope only
    ),
}


def save_tiny(folder, config):
    """HF's model for `config`, with noise on every vector (norm weights, biases): HF initialises
    them all alike (ones or zeros), which would hide a norm or bias in the wrong place."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.rand_like(param) - 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return type(model)


@pytest.mark.parametrize("config", CASES.values(), ids=CASES.keys())
def test_text_model_logits_match_hf(tmp_path, config):
    hf_cls = save_tiny(tmp_path, config)
    model = load_model(ModelConfig(str(tmp_path), device="cpu"))
    assert type(model).__name__ == hf_cls.__name__
    assert ModelRegistry.resolve_text_model_cls(config) is type(model)  # usable as a VLM's language model
    ids = torch.randint(0, config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(PROMPT_LEN)
    allocate_kv_cache(model, num_blocks=4, block_size=4, dtype=torch.float32)
    metadata = AttentionMetadata.build([PROMPT_LEN], [PROMPT_LEN], [[2, 0, 3]], block_size=4)
    with torch.no_grad(), attention_metadata(metadata):
        ours = model.compute_logits(model(ids, positions))
        # what a VLM does: embed (scaled, for Gemma 3), merge, run on the embeddings
        from_embeds = model.compute_logits(model(None, positions, model.get_input_embeddings(ids)))
        expected = hf_cls.from_pretrained(tmp_path, attn_implementation="eager")(ids[None]).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(from_embeds, ours, atol=0, rtol=0)


def test_windows_and_ropes_come_from_the_config(tmp_path):
    """Which layers are windowed, and the rotary modules layers share (cos/sin once per step)."""
    with torch.device("meta"):
        qwen2 = ModelRegistry.resolve_model_cls(["Qwen2ForCausalLM"])[0](CASES["qwen2-window"])
        gemma3 = ModelRegistry.resolve_model_cls(["Gemma3ForCausalLM"])[0](CASES["gemma3"])
        mistral = ModelRegistry.resolve_model_cls(["MistralForCausalLM"])[0](CASES["mistral-window"])
    windows = lambda m: [layer.self_attn.attn.sliding_window for layer in m.model.layers]  # noqa: E731
    ropes = lambda m: [layer.self_attn.rotary_emb for layer in m.model.layers]  # noqa: E731
    assert windows(qwen2) == [None, 4] and windows(mistral) == [4, 4] and windows(gemma3) == [4, None, 4]
    assert ropes(qwen2)[0] is ropes(qwen2)[1]
    local, glob, local_again = ropes(gemma3)
    assert local is local_again and local is not glob
