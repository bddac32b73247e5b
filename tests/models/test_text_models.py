"""Llama, Persimmon and Qwen2 as plain text models, against Hugging Face transformers (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, PersimmonConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import PersimmonForCausalLM as HFPersimmon
from transformers import Qwen2ForCausalLM as HFQwen2

from tessera.config import ModelConfig
from tessera.layers.attention import AttentionMetadata, attention_metadata
from tessera.layers.kv_cache import allocate_kv_cache
from tessera.models.loader import load_model

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)


def save_tiny(folder, hf_cls, config):
    torch.manual_seed(0)
    hf_cls(config).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize(
    "hf_cls, config",
    [
        (HFLlama, LlamaConfig(**TINY, num_key_value_heads=2)),
        (HFLlama, LlamaConfig(**TINY, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0})),
        (HFPersimmon, PersimmonConfig(**TINY)),
        (HFQwen2, Qwen2Config(**TINY, num_key_value_heads=2, rope_theta=1e6)),
        (HFQwen2, Qwen2Config(**TINY, num_key_value_heads=1, tie_word_embeddings=True)),
    ],
    ids=["llama-gqa", "llama-tied-linear-rope", "persimmon", "qwen2-gqa", "qwen2-tied-mqa"],
)
def test_text_model_logits_match_hf(tmp_path, hf_cls, config):
    folder = save_tiny(tmp_path / "m", hf_cls, config)
    model = load_model(ModelConfig(str(folder), device="cpu"))
    assert type(model).__name__ == hf_cls.__name__
    ids = torch.randint(0, config.vocab_size, (11,), generator=torch.Generator().manual_seed(1))
    allocate_kv_cache(model, num_blocks=4, block_size=4, dtype=torch.float32)
    with torch.no_grad(), attention_metadata(AttentionMetadata.build([11], [11], [[2, 0, 3]], block_size=4)):
        ours = model.compute_logits(model(ids, torch.arange(11)))
        expected = hf_cls.from_pretrained(folder, attn_implementation="eager")(ids[None]).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_a_qwen2_sliding_window_config_is_refused_at_load(tmp_path):
    folder = save_tiny(tmp_path / "m", HFQwen2, Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8))
    with pytest.raises(ValueError, match="use_sliding_window"):
        load_model(ModelConfig(str(folder), device="cpu"))
