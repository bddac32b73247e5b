"""Persimmon decoder (Fuyu's language model). Module names mirror Hugging Face's.

Differences from Llama: fused query_key_value laid out per head as (q, k, v), LayerNorm on q and
k per head, rotary on the first `rope_parameters["partial_rotary_factor"]` of each head, LayerNorm
with bias, and a squared-ReLU MLP.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import PersimmonConfig

from tessera.layers.activations import get_activation
from tessera.layers.attention import PagedAttention
from tessera.layers.linear import Linear
from tessera.models.causal_lm import CausalLM, DecoderLayer, DecoderModel


class PersimmonAttention(nn.Module):
    def __init__(self, config: PersimmonConfig, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.query_key_value = Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=True)
        self.qk_layernorm = config.qk_layernorm
        if self.qk_layernorm:
            self.q_layernorm = nn.LayerNorm(self.head_dim, eps=config.layer_norm_eps)
            self.k_layernorm = nn.LayerNorm(self.head_dim, eps=config.layer_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.num_heads, scale=self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.query_key_value(hidden_states).view(num_tokens, self.num_heads, 3, self.head_dim)
        q, k, v = qkv.unbind(dim=2)  # each [T, H, D]
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.dense(self.attn(q, k, v.contiguous()).reshape(num_tokens, -1))


class PersimmonMLP(nn.Module):
    def __init__(self, config: PersimmonConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = Linear(config.intermediate_size, config.hidden_size)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class PersimmonDecoderLayer(DecoderLayer):
    def __init__(self, config: PersimmonConfig, rotary_emb: nn.Module, sliding_window: Optional[int] = None) -> None:
        super().__init__()  # sliding_window: always None, Persimmon configs have no layer_types
        self.self_attn = PersimmonAttention(config, rotary_emb)
        self.mlp = PersimmonMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class PersimmonModel(DecoderModel):
    def __init__(self, config: PersimmonConfig) -> None:
        make_norm = lambda: nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)  # noqa: E731
        super().__init__(config, PersimmonDecoderLayer, "final_layernorm", make_norm)


class PersimmonForCausalLM(CausalLM):
    supports_tensor_parallel = False  # its fused query_key_value interleaves heads; not split yet

    def __init__(self, config: PersimmonConfig) -> None:
        super().__init__(config, PersimmonModel(config))
