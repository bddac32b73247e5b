"""Qwen3 decoder: Llama's layers with a per-head RMSNorm on q and k before rotary (`q_norm`,
`k_norm`), an explicit `head_dim`, biases only if `attention_bias`; sliding windows from
`layer_types` as Qwen2's."""

from __future__ import annotations

from functools import partial

from transformers import Qwen3Config

from tessera.layers.layernorm import RMSNorm
from tessera.models.causal_lm import CausalLM
from tessera.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel


class Qwen3Model(LlamaModel):
    def __init__(self, config: Qwen3Config) -> None:
        attention = partial(LlamaAttention, qk_norm=lambda dim: RMSNorm(dim, config.rms_norm_eps))
        super().__init__(config, partial(LlamaDecoderLayer, attention=attention))


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config, Qwen3Model(config))
