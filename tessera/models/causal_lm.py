"""The decoder skeleton every text backbone shares: layers over token embeddings, a final norm and a
language-model head. A model says only what differs: its attention, MLP and norms, the norm names.

Per layer, the skeleton reads from the config (HF 5.x fields):
- the sliding window: `layer_types[i] == "sliding_attention"` gets `sliding_window` tokens, other
  layers see the whole context (`sliding_windows`; Mistral, which has no `layer_types`, overrides);
- the rotary embedding: one module per distinct rope config, shared by the layers using it so cos/sin
  are computed once per step (one for most models; Gemma 3 nests `rope_parameters` by layer type).
"""

from __future__ import annotations

from typing import Callable, ClassVar, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from ..layers.rotary import get_rope
from ..layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

FULL, SLIDING = "full_attention", "sliding_attention"

# (config, rotary_emb, sliding_window or None) -> one decoder layer
MakeLayer = Callable[[PretrainedConfig, nn.Module, Optional[int]], nn.Module]


def head_dim_of(config: PretrainedConfig) -> int:
    """The config's explicit `head_dim` (Qwen3, Gemma 3, some Mistral), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_types_of(config: PretrainedConfig) -> list[str]:
    """HF 5.x `layer_types` (Qwen2/Qwen3 fold use_sliding_window + max_window_layers into it, Gemma 3
    its sliding pattern); all full attention for configs without it (Llama, Persimmon)."""
    layer_types = list(getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers)
    if len(layer_types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {config.num_hidden_layers} layers")
    unknown = sorted(set(layer_types) - {FULL, SLIDING})
    if unknown:
        raise ValueError(f"Unsupported layer types {unknown} in the model config; supported: {FULL}, {SLIDING}")
    return layer_types


def sliding_windows(config: PretrainedConfig) -> list[Optional[int]]:
    """Per layer, the window of a "sliding_attention" layer (`sliding_window`, which HF 5.x sets to
    None when windows are off, e.g. Qwen2 without use_sliding_window), None for full attention."""
    window = getattr(config, "sliding_window", None)
    return [window if layer_type == SLIDING else None for layer_type in layer_types_of(config)]


class DecoderLayer(nn.Module):
    """A pre-norm residual block. Subclasses set HF's module names: `self_attn` (positions [T],
    hidden [T, hidden] -> [T, hidden]), `mlp`, `input_layernorm` and `post_attention_layernorm`."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DecoderModel(nn.Module):
    """`embed_tokens`, `layers` (built by `make_layer(config, rotary_emb, sliding_window)`) and a final
    norm registered under `norm_name` (HF's name). `windows`: per-layer sliding windows when the model
    does not take them from `layer_types`; `embed_tokens`: a model's own embedding module (Gemma 3
    scales it), a `VocabParallelEmbedding` otherwise."""

    def __init__(
        self,
        config: PretrainedConfig,
        make_layer: MakeLayer,
        norm_name: str,
        make_norm: Callable[[], nn.Module],
        *,
        windows: Optional[list[Optional[int]]] = None,
        embed_tokens: Optional[nn.Embedding] = None,
    ) -> None:
        super().__init__()
        if embed_tokens is None:
            embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_tokens = embed_tokens
        windows = sliding_windows(config) if windows is None else windows
        ropes = rotary_embeddings(config)
        self.layers = nn.ModuleList(
            make_layer(config, ropes[layer_type], window) for layer_type, window in zip(layer_types_of(config), windows)
        )
        self.norm_name = norm_name
        self.add_module(norm_name, make_norm())

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden]
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return getattr(self, self.norm_name)(hidden_states)


class HybridDecoderModel(nn.Module):
    """A decoder whose layers differ in their token mixer by `layer_types` (attention, linear attention, a
    convolution: Qwen3.5, LFM2): `embed_tokens`, the layers built by `make_layer(config, layer_type,
    rotary_emb)` (one rotary embedding, shared by the attention layers), a final norm under `norm_name`."""

    def __init__(
        self,
        config: PretrainedConfig,
        make_layer: Callable[[PretrainedConfig, str, nn.Module], nn.Module],
        norm_name: str,
        make_norm: Callable[[], nn.Module],
    ) -> None:
        super().__init__()
        layer_types = list(config.layer_types)
        if len(layer_types) != config.num_hidden_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {config.num_hidden_layers} layers")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = get_rope(config, head_dim_of(config))
        self.layers = nn.ModuleList(make_layer(config, layer_type, rotary_emb) for layer_type in layer_types)
        self.norm_name = norm_name
        self.add_module(norm_name, make_norm())

    forward = DecoderModel.forward


def rotary_embeddings(config: PretrainedConfig) -> dict[str, nn.Module]:
    """Layer type -> its rotary embedding: one per distinct rope config, shared by its layers."""
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    # nested per layer type (Gemma 3: {"sliding_attention": {...}, "full_attention": {...}}), as get_rope reads it
    nested = bool(rope_parameters) and all(v is None or isinstance(v, dict) for v in rope_parameters.values())
    head_dim, ropes, by_config = head_dim_of(config), {}, {}
    for layer_type in dict.fromkeys(layer_types_of(config)):
        key = layer_type if nested else None
        if key not in by_config:
            by_config[key] = get_rope(config, head_dim, layer_type=key)
        ropes[layer_type] = by_config[key]
    return ropes


class CausalLM(nn.Module):
    """`model` maps ids or embeddings [T(, hidden)] and positions [T] to hidden states [T, hidden];
    `lm_head` maps them to logits (tied to the input embeddings if the config says so)."""

    final_logit_softcapping: Optional[float] = None
    """Logits become cap * tanh(logits / cap) when set (Gemma 2/3/4's `final_logit_softcapping`)."""

    supports_tensor_parallel: ClassVar[bool] = True
    """Whether the decoder's layers split over tensor-parallel ranks (heads and MLP channels); a model
    whose layers do not sets False, and loading it with tensor_parallel_size > 1 fails."""

    def __init__(self, config: PretrainedConfig, model: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden], what `forward` feeds the first layer (scaled where the model scales)."""
        return self.model.embed_tokens(input_ids)

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the new tokens."""
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab]."""
        logits = self.lm_head(hidden_states)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
