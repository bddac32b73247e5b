"""LFM2 (Liquid AI): a hybrid decoder of short gated convolutions and attention (`layer_types`: "conv" /
"full_attention"), the language model of LFM2-VL. As transformers' modeling_lfm2.py; module names mirror it.

- Short convolution: `in_proj` -> B, C, x (in that order); y = C * conv(B * x), a causal depthwise conv of
  width `conv_L_cache`; `out_proj`. No activation. Its state per sequence: the last L - 1 values of B * x.
- Attention: per-head RMSNorm on q and k (`q_layernorm`, `k_layernorm`) before rotary; `out_proj`.
- MLP: SwiGLU `w2(silu(w1 x) * w3 x)`, its width adjusted from `intermediate_size` as HF does
  (`block_auto_adjust_ff_dim`).
- Norms: `operator_norm` before the mixer, `ffn_norm` before the MLP, `embedding_norm` after the last layer.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tessera.layers.attention import PagedAttention, get_attention_metadata
from tessera.layers.causal_conv1d import causal_conv1d
from tessera.layers.layernorm import RMSNorm
from tessera.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tessera.layers.state_cache import StatefulLayer, StateSpec
from tessera.models.causal_lm import CausalLM, HybridDecoderModel, head_dim_of

CONV, FULL_ATTENTION = "conv", "full_attention"


def feed_forward_width(config: PretrainedConfig) -> int:
    """HF's Lfm2MLP width: 2/3 of intermediate_size, times the multiplier, rounded up to block_multiple_of."""
    width = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        width = int(2 * width / 3)
        multiplier = getattr(config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            width = int(multiplier * width)
            multiple = config.block_multiple_of
            width = multiple * ((width + multiple - 1) // multiple)
    return width


class Lfm2MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        width = feed_forward_width(config)
        self.w13 = MergedColumnParallelLinear(config.hidden_size, {"w1": width, "w3": width}, bias=False)
        self.w2 = RowParallelLinear(width, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13.split(self.w13(x))
        return self.w2(torch.nn.functional.silu(gate) * up)


class Lfm2Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, head_dim_of(config)
        self.num_kv_heads = config.num_key_value_heads
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedColumnParallelLinear(
            config.hidden_size, {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_width}, bias=False
        )
        self.out_proj = RowParallelLinear(q_width, config.hidden_size, bias=False)
        self.q_layernorm = RMSNorm(self.head_dim, config.norm_eps)
        self.k_layernorm = RMSNorm(self.head_dim, config.norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.num_kv_heads, scale=self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q = self.q_layernorm(q.view(num_tokens, self.num_heads, self.head_dim))
        k = self.k_layernorm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        return self.out_proj(out.reshape(num_tokens, -1))


class Lfm2ShortConv(StatefulLayer):
    """y = out_proj(C * conv(B * x)); state per sequence: `conv_state` [hidden, L - 1] (the last B * x values)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, self.kernel_size = config.hidden_size, config.conv_L_cache
        if self.kernel_size < 2:
            raise ValueError(f"conv_L_cache must be at least 2, got {self.kernel_size}")
        bias = getattr(config, "conv_bias", False)
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.conv = nn.Conv1d(hidden, hidden, self.kernel_size, groups=hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)
        self.conv_state = torch.empty(0)  # bound by allocate_state_cache

    def state_specs(self) -> dict[str, StateSpec]:
        return {"conv_state": ((self.conv.in_channels, self.kernel_size - 1), None)}

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        metadata = get_attention_metadata()
        slots = self.zero_fresh_states(metadata)
        b, c, x = self.in_proj(hidden_states).chunk(3, dim=-1)  # [T, hidden] each
        conv_out = causal_conv1d(b * x, self.conv.weight[:, 0], self.conv.bias, self.conv_state, slots,
                                 metadata.query_lens, metadata.state_snapshots)  # fmt: skip
        return self.out_proj(c * conv_out)


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_type: str, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == CONV:
            self.conv = Lfm2ShortConv(config)
        elif layer_type == FULL_ATTENTION:
            self.self_attn = Lfm2Attention(config, rotary_emb)
        else:
            raise ValueError(f"Unsupported LFM2 layer type {layer_type!r}; supported: {CONV}, {FULL_ATTENTION}")
        self.feed_forward = Lfm2MLP(config)
        self.operator_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        mixer = self.conv if self.layer_type == CONV else self.self_attn
        hidden_states = hidden_states + mixer(positions, self.operator_norm(hidden_states))
        return hidden_states + self.feed_forward(self.ffn_norm(hidden_states))


class Lfm2Model(HybridDecoderModel):
    def __init__(self, config: PretrainedConfig) -> None:
        make_norm = lambda: RMSNorm(config.hidden_size, config.norm_eps)  # noqa: E731
        super().__init__(config, Lfm2DecoderLayer, "embedding_norm", make_norm)  # HF's name for the final norm


class Lfm2ForCausalLM(CausalLM):
    supports_tensor_parallel = False  # the short convolutions are not split over ranks yet

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config, Lfm2Model(config))
