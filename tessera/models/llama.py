"""Llama decoder, usable alone as a text model or as the language model of LLaVA.

Module names mirror Hugging Face's, so checkpoints load without renaming. Inputs are flattened
across sequences: `[num_tokens]` ids and positions, `[num_tokens, hidden]` activations.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from transformers import LlamaConfig

from tessera.distributed import divide, get_tp_group
from tessera.layers.activations import get_activation
from tessera.layers.attention import PagedAttention
from tessera.layers.layernorm import RMSNorm
from tessera.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tessera.models.causal_lm import CausalLM, DecoderLayer, DecoderModel, MakeLayer, head_dim_of
from tessera.models.native_decode import NativeDecodeLayer, native_layer_for_step


class LlamaAttention(nn.Module):
    """q/k/v projections (fused), rotary, paged attention (windowed on sliding layers), o_proj."""

    def __init__(
        self,
        config: LlamaConfig,
        rotary_emb: nn.Module,
        sliding_window: Optional[int] = None,
        *,
        qkv_bias: Optional[bool] = None,
        o_bias: Optional[bool] = None,
        qk_norm: Optional[Callable[[int], nn.Module]] = None,
        scale: Optional[float] = None,
    ) -> None:
        """`qkv_bias` / `o_bias`: the config's `attention_bias` unless a model says otherwise
        (Qwen2 has biases on q, k and v only). `qk_norm(head_dim)`: the per-head norm applied to q
        and k before rotary (`q_norm`, `k_norm`: Qwen3, Gemma 3). `scale`: head_dim ** -0.5 unless
        given (Gemma 3: query_pre_attn_scalar ** -0.5)."""
        super().__init__()
        # With tensor parallelism each rank holds num_heads / tp query heads and num_kv_heads / tp kv heads.
        tp = get_tp_group().world_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.num_heads = divide(total_heads, tp, "num_attention_heads")
        self.num_kv_heads = divide(total_kv_heads, tp, "num_key_value_heads")
        self.head_dim = head_dim_of(config)
        bias = getattr(config, "attention_bias", False)
        q_width, kv_width = total_heads * self.head_dim, total_kv_heads * self.head_dim
        shards = {"q_proj": q_width, "k_proj": kv_width, "v_proj": kv_width}
        self.qkv_proj = MergedColumnParallelLinear(
            config.hidden_size, shards, bias=bias if qkv_bias is None else qkv_bias
        )
        self.o_proj = RowParallelLinear(q_width, config.hidden_size, bias=bias if o_bias is None else o_bias)
        self.q_norm = qk_norm(self.head_dim) if qk_norm else None
        self.k_norm = qk_norm(self.head_dim) if qk_norm else None
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(
            self.num_heads,
            self.head_dim,
            self.num_kv_heads,
            scale=self.head_dim**-0.5 if scale is None else scale,
            sliding_window=sliding_window,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v).reshape(num_tokens, -1))


class LlamaMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); `activation` defaults to the config's `hidden_act`, the width to its
    `intermediate_size`."""

    def __init__(
        self, config: LlamaConfig, activation: Optional[str] = None, intermediate_size: Optional[int] = None
    ) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        width = intermediate_size or config.intermediate_size
        shards = {"gate_proj": width, "up_proj": width}
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, shards, bias=bias)
        self.down_proj = RowParallelLinear(width, config.hidden_size, bias=bias)
        self.activation = activation or config.hidden_act
        self.act = get_activation(self.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(DecoderLayer):
    def __init__(
        self,
        config: LlamaConfig,
        rotary_emb: nn.Module,
        sliding_window: Optional[int] = None,
        attention: Callable[..., nn.Module] = LlamaAttention,
    ) -> None:
        super().__init__()
        self.self_attn = attention(config, rotary_emb, sliding_window)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._native: Optional[NativeDecodeLayer] | bool = None  # built on the first decode step; False: none

    NATIVE_NORMS = {"input": "input_layernorm", "post": "post_attention_layernorm"}
    """The native decode layer's norm roles (native_decode.py) -> this layer's norms."""

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Decode steps run the native decode layer where it can (native_decode.py), else the eager modules."""
        native = native_layer_for_step(self, hidden_states)
        if native is not None:
            return native(positions, hidden_states)
        return super().forward(positions, hidden_states)


class LlamaModel(DecoderModel):
    """Llama's decoder; the Llama-shaped models (Qwen2, Qwen3, Mistral) pass their own layers or
    windows."""

    def __init__(
        self,
        config: LlamaConfig,
        make_layer: MakeLayer = LlamaDecoderLayer,
        windows: Optional[list[Optional[int]]] = None,
    ) -> None:
        make_norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps)  # noqa: E731
        super().__init__(config, make_layer, "norm", make_norm, windows=windows)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config, LlamaModel(config))
