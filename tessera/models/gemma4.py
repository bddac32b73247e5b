"""Gemma 4 text decoder (`model_type` "gemma4_text": Gemma4ForCausalLM, and the language model of Gemma 4 VLMs),
dense and MoE. Module names mirror Hugging Face's (transformers 5.23, modeling_gemma4.py).

What differs from Gemma 3 (gemma3.py), as HF computes it:
- RMSNorm scales by `weight` itself (no 1 +), in float32; v_norm and the router's norm have no weight;
- attention: q_norm and k_norm (with weight) before rotary, v_norm on the values, scale 1.0; geometry per layer
  (`config.per_layer_config`: full-attention layers have `global_head_dim` and, with `attention_k_eq_v`,
  `num_global_key_value_heads` heads whose values are the keys' raw projection: no v_proj);
- rope per layer type: the sliding layers' plain rope, the full layers' "proportional" one (rotary.py);
- KV sharing (`num_kv_shared_layers`): the last layers have only q_proj, q_norm and o_proj and attend over the
  cache of the last earlier layer of their type ("store"), writing none (layers/attention.py `reads_kv_of`):
  the cache holds those layers once;
- per-layer input embeddings (PLE, `hidden_size_per_layer_input` P > 0): a second token embedding of
  [vocab_size_per_layer_input, layers * P] plus a projection of the input embeddings give each layer a [P] input,
  gated into the residual stream after its MLP;
- `layer_scalar` (a checkpoint buffer) scales each layer's output;
- with `enable_moe_block`, routed experts run beside the dense MLP in every layer (router with a weightless
  norm, a learned scale and per-expert scales; layers/fused_moe.py for the experts);
- `use_bidirectional_attention` "vision": image and video runs attend both ways on sliding layers only.
HF sends only the tokens whose logits it needs through the KV-shared layers; they write no cache, so running
every token through them gives the same sampled logits.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from tessera.distributed import divide, get_tp_group
from tessera.layers.attention import PagedAttention
from tessera.layers.fused_moe import FusedMoE, softmax_top_k
from tessera.layers.linear import Linear, MergedColumnParallelLinear, RowParallelLinear
from tessera.layers.rotary import get_rope
from tessera.models.causal_lm import SLIDING, CausalLM, layer_types_of, sliding_windows
from tessera.models.gemma3 import Gemma3TextScaledWordEmbedding
from tessera.models.llama import LlamaMLP

STORE, REUSE = "store", "reuse"


class Gemma4RMSNorm(nn.Module):
    """x * (mean(x^2) + eps) ** -0.5 [* weight], in float32, cast back (HF's op order: pow, not rsqrt)."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


class Gemma4Attention(nn.Module):
    """q (and, unless the layer reads another's cache, k and v) projections, their norms, rotary, paged attention."""

    def __init__(self, config: Any, index: int, rotary_emb: nn.Module, sliding_window: Optional[int],
                 reads_kv_of: Optional[PagedAttention] = None) -> None:  # fmt: skip
        super().__init__()
        geometry, tp = config.per_layer_config[index], get_tp_group().world_size
        self.head_dim = geometry.head_dim  # with tensor parallelism each rank holds its share of the heads
        self.num_heads = divide(config.num_attention_heads, tp, "num_attention_heads")
        self.num_kv_heads = divide(geometry.num_key_value_heads, tp, f"layer {index}'s num_key_value_heads")
        sliding = layer_types_of(config)[index] == SLIDING
        self.values_are_keys = bool(config.attention_k_eq_v) and not sliding
        q_width = config.num_attention_heads * self.head_dim
        kv_width = geometry.num_key_value_heads * self.head_dim
        shards = {"q_proj": q_width}
        if reads_kv_of is None:
            shards["k_proj"] = kv_width
            if not self.values_are_keys:
                shards["v_proj"] = kv_width
        self.qkv_proj = MergedColumnParallelLinear(config.hidden_size, shards, bias=config.attention_bias)
        self.o_proj = RowParallelLinear(q_width, config.hidden_size, bias=config.attention_bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
        if reads_kv_of is None:
            self.k_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, config.rms_norm_eps, with_scale=False)
        self.rotary_emb = rotary_emb
        both_ways = getattr(config, "use_bidirectional_attention", None) == "vision" and sliding
        self.attn = PagedAttention(self.num_heads, self.head_dim, self.num_kv_heads, scale=1.0,
                                   sliding_window=sliding_window, bidirectional_spans=both_ways,
                                   reads_kv_of=reads_kv_of)  # fmt: skip

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        parts = self.qkv_proj.split(self.qkv_proj(hidden_states))
        q = self.q_norm(parts[0].view(num_tokens, self.num_heads, self.head_dim))  # [T, H, D]
        if self.attn.kv_source:  # the keys and values are the store layer's, already in the cache
            q, _ = self.rotary_emb(positions, q, q[:, :0])
            return self.o_proj(self.attn(q, None, None).reshape(num_tokens, -1))
        k = parts[1].view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_norm(k if self.values_are_keys else parts[2].view(num_tokens, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, self.k_norm(k))
        return self.o_proj(self.attn(q, k, v).reshape(num_tokens, -1))


class Gemma4Router(nn.Module):
    """Routing: a weightless RMSNorm, times `scale` and hidden ** -0.5, `proj` to the experts, softmax top-k
    renormalised, each weight times its expert's `per_expert_scale`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = config.top_k_experts
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.proj = Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))
        self.root_size = config.hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k])."""
        logits = self.proj(self.norm(x) * self.scale * self.root_size)
        weights, ids = softmax_top_k(logits, self.top_k)
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: Any, index: int, rotary_emb: nn.Module, sliding_window: Optional[int],
                 reads_kv_of: Optional[PagedAttention] = None) -> None:  # fmt: skip
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, index, rotary_emb, sliding_window, reads_kv_of)
        wide = bool(getattr(config, "use_double_wide_mlp", False)) and reads_kv_of is not None
        self.mlp = LlamaMLP(config, config.hidden_activation, config.intermediate_size * (2 if wide else 1))
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):  # fmt: skip
            self.add_module(name, Gemma4RMSNorm(hidden, eps))
        self.register_buffer("layer_scalar", torch.ones(1))
        self.per_layer_size = config.hidden_size_per_layer_input or 0
        if self.per_layer_size:
            self.per_layer_input_gate = Linear(hidden, self.per_layer_size, bias=False)
            self.per_layer_projection = Linear(self.per_layer_size, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        self.router = None
        if config.enable_moe_block:
            self.router = Gemma4Router(config)
            self.experts = FusedMoE(config.num_experts, config.top_k_experts, hidden, config.moe_intermediate_size,
                                    config.hidden_activation)  # fmt: skip
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                self.add_module(name, Gemma4RMSNorm(hidden, eps))
        self.act = self.mlp.act

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                per_layer_input: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
        """hidden_states [T, H], per_layer_input [T, P] (PLE models) -> [T, H]."""
        attn_out = self.self_attn(positions, self.input_layernorm(hidden_states))
        residual = hidden_states + self.post_attention_layernorm(attn_out)
        out = self.mlp(self.pre_feedforward_layernorm(residual))
        if self.router is not None:  # the experts beside the dense MLP, each normed on its own
            weights, expert_ids = self.router(residual)
            routed = self.experts(self.pre_feedforward_layernorm_2(residual), weights, expert_ids)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        hidden_states = residual + self.post_feedforward_layernorm(out)
        if self.per_layer_size:
            gated = self.act(self.per_layer_input_gate(hidden_states)) * per_layer_input
            hidden_states = hidden_states + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden_states * self.layer_scalar


class Gemma4TextModel(nn.Module):
    """`embed_tokens` (times sqrt(hidden)), the layers, `norm`; with PLE also `embed_tokens_per_layer`,
    `per_layer_model_projection` and `per_layer_projection_norm`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise ValueError("This Gemma 4 config sets use_bidirectional_attention='all' (an encoder): not a "
                             "causal language model.")  # fmt: skip
        self.config = config
        hidden, layers = config.hidden_size, config.num_hidden_layers
        self.embed_tokens = Gemma3TextScaledWordEmbedding(config.vocab_size, hidden, hidden**0.5)
        layer_types, modes = layer_types_of(config), config.kv_sharing_modes
        ropes = {t: get_rope(config, config.per_layer_config[t].head_dim, layer_type=t) for t in set(layer_types)}
        self.layers = nn.ModuleList()
        stores: dict[str, PagedAttention] = {}
        for index, (layer_type, window) in enumerate(zip(layer_types, sliding_windows(config))):
            source = stores[layer_type] if modes[index] == REUSE else None
            layer = Gemma4DecoderLayer(config, index, ropes[layer_type], window, source)
            if modes[index] == STORE:
                stores[layer_type] = layer.self_attn.attn
            self.layers.append(layer)
        self.norm = Gemma4RMSNorm(hidden, config.rms_norm_eps)
        self.per_layer_size = config.hidden_size_per_layer_input or 0
        if self.per_layer_size:
            size = self.per_layer_size
            self.embed_tokens_per_layer = Gemma3TextScaledWordEmbedding(config.vocab_size_per_layer_input,
                                                                        layers * size, size**0.5)  # fmt: skip
            self.per_layer_model_projection = Linear(hidden, layers * size, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(size, config.rms_norm_eps)
        # released files may keep the projections HF's KV-shared layers no longer have
        self.unused_checkpoint_names = tuple(
            f"layers.{i}.self_attn.{name}" for i, mode in enumerate(modes) if mode == REUSE
            for name in ("k_proj", "v_proj", "k_norm", "v_norm")
        )  # fmt: skip

    def per_layer_inputs(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """[T] ids (placeholders already replaced by the pad id), [T, H] embeddings -> [T, layers, P]."""
        shape = (input_ids.shape[0], len(self.layers), self.per_layer_size)
        tokens = self.embed_tokens_per_layer(input_ids).reshape(shape)
        context = self.per_layer_model_projection(inputs_embeds) * self.config.hidden_size**-0.5
        return (self.per_layer_projection_norm(context.reshape(shape)) + tokens) * 2**-0.5

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
        """ids [T] and/or embeddings [T, H] (PLE needs the ids too), positions [T] -> hidden states [T, H]."""
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer = [None] * len(self.layers)
        if self.per_layer_size:
            if input_ids is None:
                raise ValueError("Gemma 4's per-layer embeddings need the token ids along with the embeddings")
            per_layer = self.per_layer_inputs(input_ids, hidden_states).unbind(1)
        for layer, layer_input in zip(self.layers, per_layer):
            hidden_states = layer(positions, hidden_states, layer_input)
        return self.norm(hidden_states)


class Gemma4ForCausalLM(CausalLM):
    takes_input_ids_with_embeds = True  # the per-layer embeddings look the ids up (model_inputs.run_model)

    def __init__(self, config: Any) -> None:
        super().__init__(config, Gemma4TextModel(config))
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.ignored_checkpoint_prefixes = tuple(f"model.{name}" for name in self.model.unused_checkpoint_names)
