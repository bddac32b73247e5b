"""Qwen2 (and Qwen2.5) decoder: Llama's layers with biases on the q, k and v projections, usable
alone as a text model or as the language model of a VLM (`text_config.model_type` "qwen2").

Sliding-window attention (`use_sliding_window`) is refused at load until the paged attention
has windows: running it with full attention would silently change long-prompt answers."""

from __future__ import annotations

from functools import partial

from transformers import Qwen2Config

from tessera.layers.layernorm import RMSNorm
from tessera.models.causal_lm import CausalLM, DecoderModel
from tessera.models.llama import LlamaAttention, LlamaDecoderLayer


class Qwen2Model(DecoderModel):
    def __init__(self, config: Qwen2Config) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError(
                "This Qwen2 config sets use_sliding_window; sliding-window attention is not supported yet. "
                "Set use_sliding_window to false only if prompts never exceed the window."
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        attention = partial(LlamaAttention, qkv_bias=True, o_bias=False)
        make_layer = partial(LlamaDecoderLayer, attention=attention)
        make_norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps)  # noqa: E731
        super().__init__(config, head_dim, make_layer, "norm", make_norm)


class Qwen2ForCausalLM(CausalLM):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__(config, Qwen2Model(config))
