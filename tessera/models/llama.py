"""Llama decoder, usable alone as a text model or as the language model of LLaVA.

Module names mirror Hugging Face's, so checkpoints load without renaming. Inputs are flattened
across sequences: `[num_tokens]` ids and positions, `[num_tokens, hidden]` activations.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import LlamaConfig

from tessera.layers.activations import get_activation
from tessera.layers.attention import PagedAttention
from tessera.layers.layernorm import RMSNorm
from tessera.layers.linear import Linear, MergedLinear
from tessera.layers.rotary import RotaryEmbedding
from tessera.models.causal_lm import CausalLM, DecoderLayer, DecoderModel


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        rotary_emb: RotaryEmbedding,
        *,
        qkv_bias: Optional[bool] = None,
        o_bias: Optional[bool] = None,
    ) -> None:
        """`qkv_bias` / `o_bias`: the config's `attention_bias` unless a model says otherwise
        (Qwen2 has biases on q, k and v only)."""
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False)
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shards = {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_width}
        self.qkv_proj = MergedLinear(config.hidden_size, shards, bias=bias if qkv_bias is None else qkv_bias)
        self.o_proj = Linear(
            self.num_heads * self.head_dim, config.hidden_size, bias=bias if o_bias is None else o_bias
        )
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.num_kv_heads, scale=self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v).reshape(num_tokens, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        shards = {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
        self.gate_up_proj = MergedLinear(config.hidden_size, shards, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, config: LlamaConfig, rotary_emb: RotaryEmbedding, attention: type = LlamaAttention) -> None:
        super().__init__()
        self.self_attn = attention(config, rotary_emb)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(DecoderModel):
    def __init__(self, config: LlamaConfig) -> None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        make_norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps)  # noqa: E731
        super().__init__(config, head_dim, LlamaDecoderLayer, "norm", make_norm)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config, LlamaModel(config))
