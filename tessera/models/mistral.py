"""Mistral decoder: Llama with a sliding window on every layer (`sliding_window`, None for none).

HF's Mistral ignores `layer_types` (configs that alternate windows are Ministral's): so does this."""

from __future__ import annotations

from transformers import MistralConfig

from tessera.models.causal_lm import CausalLM
from tessera.models.llama import LlamaDecoderLayer, LlamaModel


class MistralModel(LlamaModel):
    def __init__(self, config: MistralConfig) -> None:
        windows = [getattr(config, "sliding_window", None)] * config.num_hidden_layers
        super().__init__(config, LlamaDecoderLayer, windows=windows)


class MistralForCausalLM(CausalLM):
    def __init__(self, config: MistralConfig) -> None:
        super().__init__(config, MistralModel(config))
