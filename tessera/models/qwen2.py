"""Qwen2 (and Qwen2.5) decoder: Llama's layers with biases on the q, k and v projections, usable
alone as a text model or as the language model of a VLM (`text_config.model_type` "qwen2").

Sliding windows come from HF 5.x's `layer_types`, into which Qwen2Config folds `use_sliding_window`
and `max_window_layers` (layers from max_window_layers on are windowed; none when it is off)."""

from __future__ import annotations

from functools import partial

from transformers import Qwen2Config

from tessera.models.causal_lm import CausalLM
from tessera.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel


class Qwen2Model(LlamaModel):
    def __init__(self, config: Qwen2Config) -> None:
        attention = partial(LlamaAttention, qkv_bias=True, o_bias=False)
        super().__init__(config, partial(LlamaDecoderLayer, attention=attention))


class Qwen2ForCausalLM(CausalLM):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__(config, Qwen2Model(config))
