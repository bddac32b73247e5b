"""The decoder skeleton Llama and Persimmon share: pre-norm layers over token embeddings, a final
norm and a language-model head. Each model brings its own attention, MLP and norms."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from ..layers.linear import Linear
from ..layers.rotary import RotaryEmbedding


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
    """`embed_tokens`, `layers` (built by `make_layer(config, rotary_emb)`, one rotary embedding for
    all of them: cos/sin once per step) and a final norm registered under `norm_name` (HF's name)."""

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        make_layer: Callable[[PretrainedConfig, RotaryEmbedding], nn.Module],
        norm_name: str,
        make_norm: Callable[[], nn.Module],
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rotary_emb = RotaryEmbedding(config, head_dim)
        self.layers = nn.ModuleList(make_layer(config, rotary_emb) for _ in range(config.num_hidden_layers))
        self.norm_name = norm_name
        self.add_module(norm_name, make_norm())

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden]
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return getattr(self, self.norm_name)(hidden_states)


class CausalLM(nn.Module):
    """`model` maps ids or embeddings [T(, hidden)] and positions [T] to hidden states [T, hidden];
    `lm_head` maps them to logits (tied to the input embeddings if the config says so)."""

    def __init__(self, config: PretrainedConfig, model: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, inputs_embeds: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the new tokens."""
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab]."""
        return self.lm_head(hidden_states)
