"""Qwen3.5 (dense): a hybrid decoder of Gated DeltaNet layers (linear attention with a per-sequence state)
and gated full-attention layers (`layer_types`: "linear_attention" / "full_attention", three to one in the
published models), under Qwen3-VL's vision tower without DeepStack and its processing (Qwen3VLProcessor).
As transformers' modeling_qwen3_5.py; module names mirror it so checkpoints load as they are.

- Norms are zero-centred (x / rms(x) * (1 + weight)), as Gemma's, except the gated norm of the DeltaNet's
  output (weight * x / rms(x) * silu(z)).
- Full attention: `q_proj` gives each head its query and, beside it, a gate; the output is multiplied by
  sigmoid(gate) before `o_proj`. q and k get a per-head norm; rotary covers a part of each head
  (`partial_rotary_factor`) with interleaved M-RoPE.
- Gated DeltaNet: q, k, v from `in_proj_qkv` through a causal depthwise conv (width `linear_conv_kernel_dim`,
  SiLU), the gated delta rule over value heads (each key head serves num_v / num_k value heads), the gated
  norm, `out_proj`. Its state per sequence: the conv's last inputs and the recurrent matrix per value head
  (fp32), in the engine's state slots (layers/state_cache.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, Qwen3_5Config, Qwen3_5MoeConfig

from tessera.layers.attention import PagedAttention, get_attention_metadata
from tessera.layers.causal_conv1d import causal_conv1d
from tessera.layers.gated_delta_rule import chunked, l2norm, recurrent_step
from tessera.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tessera.layers.state_cache import StatefulLayer, StateSpec
from tessera.models.causal_lm import CausalLM, HybridDecoderModel, head_dim_of
from tessera.models.gemma3 import Gemma3RMSNorm
from tessera.models.interfaces import MultiModalEmbeddings, SupportsMRoPE, SupportsMultiModal
from tessera.models.llama import LlamaMLP
from tessera.models.qwen3_vl import (
    Qwen3VLDummyInputsBuilder,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMultiModalProcessor,
    Qwen3VLProcessingInfo,
)
from tessera.models.qwen_moe import QwenSparseMoeBlock
from tessera.multimodal import MULTIMODAL_REGISTRY

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


class Qwen3_5Attention(nn.Module):
    """Full attention with an output gate: q_proj -> per head [query | gate]."""

    def __init__(self, config: PretrainedConfig, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, head_dim_of(config)
        self.num_kv_heads = config.num_key_value_heads
        bias = getattr(config, "attention_bias", False)
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shards = {"q_proj": 2 * q_width, "k_proj": kv_width, "v_proj": kv_width}
        self.qkv_proj = MergedColumnParallelLinear(config.hidden_size, shards, bias=bias)
        self.o_proj = RowParallelLinear(q_width, config.hidden_size, bias=bias)
        self.q_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.num_kv_heads, scale=self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # per head
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v.reshape(num_tokens, self.num_kv_heads, self.head_dim)).reshape(num_tokens, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(num_tokens, -1)))


class GatedRMSNorm(nn.Module):
    """weight * x / rms(x) (in float32, back to x's dtype) * silu(gate), per value head."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class Qwen3_5GatedDeltaNet(StatefulLayer):
    """Linear attention by the gated delta rule; states: `conv_state` [conv_dim, K - 1] and `recurrent_state`
    [num_v_heads, key_head_dim, value_head_dim] (fp32) per sequence."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads {self.num_v_heads} is not a multiple of "
                f"linear_num_key_heads {self.num_k_heads}"
            )
        key_width, value_width = self.num_k_heads * self.key_dim, self.num_v_heads * self.value_dim
        self.conv_dim = 2 * key_width + value_width
        self.kernel_size = config.linear_conv_kernel_dim
        if self.kernel_size < 2:
            raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {self.kernel_size}")
        shards = {"in_proj_qkv": self.conv_dim, "in_proj_z": value_width, "in_proj_b": self.num_v_heads,
                  "in_proj_a": self.num_v_heads}  # fmt: skip
        self.in_proj = MergedColumnParallelLinear(config.hidden_size, shards, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_width, config.hidden_size, bias=False)
        self.conv_state = torch.empty(0)  # bound by allocate_state_cache
        self.recurrent_state = torch.empty(0)

    def state_specs(self) -> dict[str, StateSpec]:
        return {
            "conv_state": ((self.conv_dim, self.kernel_size - 1), None),
            "recurrent_state": ((self.num_v_heads, self.key_dim, self.value_dim), torch.float32),
        }

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        metadata = get_attention_metadata()
        slots = self.zero_fresh_states(metadata)
        num_tokens, dtype = hidden_states.shape[0], hidden_states.dtype
        mixed, z, b, a = self.in_proj.split(self.in_proj(hidden_states))
        weight = self.conv1d.weight[:, 0]  # [conv_dim, K]
        conv = causal_conv1d(mixed, weight, None, self.conv_state, slots, metadata.query_lens, metadata.state_snapshots)
        mixed = F.silu(conv)
        key_width = self.num_k_heads * self.key_dim
        q, k, v = mixed.split([key_width, key_width, self.num_v_heads * self.value_dim], dim=-1)
        repeat = self.num_v_heads // self.num_k_heads  # value head j reads key head j // repeat
        q = l2norm(q.float().view(num_tokens, self.num_k_heads, self.key_dim)).repeat_interleave(repeat, dim=1)
        k = l2norm(k.float().view(num_tokens, self.num_k_heads, self.key_dim)).repeat_interleave(repeat, dim=1)
        q = q * self.key_dim**-0.5
        v = v.float().view(num_tokens, self.num_v_heads, self.value_dim)
        beta = b.float().sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [T, Hv], log decay
        out = self._delta_rule(q, k, v, g, beta, slots, metadata)  # [T, Hv, dv] fp32
        z = z.view(num_tokens, self.num_v_heads, self.value_dim)
        out = self.norm(out.to(dtype), z).reshape(num_tokens, -1)
        return self.out_proj(out)

    def _delta_rule(self, q, k, v, g, beta, slots: list[int], metadata: Any) -> torch.Tensor:  # noqa: ANN001
        """Decode tokens batched through the recurrence; each prompt chunk in the chunked form, split where the
        step keeps a snapshot of the state (metadata.state_snapshots)."""
        out = torch.empty_like(v)
        starts = [0]
        for n in metadata.query_lens:
            starts.append(starts[-1] + n)
        state, snapshots = self.recurrent_state, metadata.state_snapshots
        decode = [i for i, n in enumerate(metadata.query_lens) if n == 1]
        if decode:
            rows = torch.tensor([starts[i] for i in decode], device=v.device)
            index = torch.tensor([slots[i] for i in decode], device=v.device)
            out[rows], state[index] = recurrent_step(q[rows], k[rows], v[rows], g[rows], beta[rows], state[index])
            for i in decode:
                for _, row in snapshots.get(i, ()):
                    state[row] = state[slots[i]]
        for i, n in enumerate(metadata.query_lens):
            if n == 1:
                continue
            seq_state, lo = state[slots[i]], 0
            for hi, row in [*snapshots.get(i, ()), (n, None)]:  # split where the state is kept
                if hi > lo:
                    rows = slice(starts[i] + lo, starts[i] + hi)
                    seq_out, seq_state = chunked(
                        q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1),
                        g[rows].t(), beta[rows].t(), seq_state,
                    )  # fmt: skip
                    out[rows] = seq_out.transpose(0, 1)
                if row is not None:
                    state[row] = seq_state
                lo = hi
            state[slots[i]] = seq_state
        return out


class Qwen3_5DecoderLayer(nn.Module):
    """Pre-norm residual block; the token mixer is `linear_attn` or `self_attn` by the layer's type."""

    def __init__(self, config: PretrainedConfig, layer_type: str, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = Qwen3_5GatedDeltaNet(config)
        elif layer_type == FULL_ATTENTION:
            self.self_attn = Qwen3_5Attention(config, rotary_emb)
        else:
            raise ValueError(
                f"Unsupported Qwen3.5 layer type {layer_type!r}; supported: {LINEAR_ATTENTION}, {FULL_ATTENTION}"
            )
        # Qwen3.5-MoE: routed experts and a shared expert in every layer
        self.mlp = QwenSparseMoeBlock(config) if getattr(config, "num_experts", 0) else LlamaMLP(config)
        self.input_layernorm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        mixer = self.linear_attn if self.layer_type == LINEAR_ATTENTION else self.self_attn
        hidden_states = hidden_states + mixer(positions, self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Qwen3_5TextModel(HybridDecoderModel):
    def __init__(self, config: PretrainedConfig) -> None:
        make_norm = lambda: Gemma3RMSNorm(config.hidden_size, config.rms_norm_eps)  # noqa: E731
        super().__init__(config, Qwen3_5DecoderLayer, "norm", make_norm)  # rotary: partial, interleaved M-RoPE


class Qwen3_5ForCausalLM(CausalLM, SupportsMRoPE):
    """The text model alone (`qwen3_5_text`); also the language model of Qwen3_5ForConditionalGeneration.
    Its rope is M-RoPE: text-only prompts take the same index on the three axes."""

    supports_tensor_parallel = False  # the DeltaNet's heads are not split over ranks yet

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config, Qwen3_5TextModel(config))

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: Sequence[Any]
    ) -> tuple[torch.Tensor, int]:
        if mm_features:
            raise ValueError("Qwen3.5's text model takes no images or videos")
        return torch.arange(len(input_tokens)).expand(3, -1), 0


class Qwen3_5ProcessingInfo(Qwen3VLProcessingInfo):
    def get_hf_config(self) -> Qwen3_5Config:
        return self.ctx.get_hf_config(Qwen3_5Config)


@MULTIMODAL_REGISTRY.register_processor(
    Qwen3VLMultiModalProcessor, info=Qwen3_5ProcessingInfo, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL's tower (no DeepStack features) and processing over the hybrid decoder."""

    supports_tensor_parallel = False

    def _run_vision_tower(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        merged, _ = self.visual(pixel_values, grid_thw)
        return merged

    def get_input_embeddings(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: Optional[MultiModalEmbeddings] = None,
        *,
        is_multimodal: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        return SupportsMultiModal.get_input_embeddings(
            self, input_ids, multimodal_embeddings, is_multimodal=is_multimodal
        )

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, inputs_embeds)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE's text model (`qwen3_5_moe_text`): the same hybrid decoder, its MLPs routed experts with a
    shared expert (qwen_moe.py); the released files' multi-token-prediction head (`mtp.*`) is not run."""

    ignored_checkpoint_prefixes = ("mtp.",)


class Qwen3_5MoeProcessingInfo(Qwen3VLProcessingInfo):
    def get_hf_config(self) -> Qwen3_5MoeConfig:
        return self.ctx.get_hf_config(Qwen3_5MoeConfig)


@MULTIMODAL_REGISTRY.register_processor(
    Qwen3VLMultiModalProcessor, info=Qwen3_5MoeProcessingInfo, dummy_inputs=Qwen3VLDummyInputsBuilder
)
class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    ignored_checkpoint_prefixes = ("mtp.",)
