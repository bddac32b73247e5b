"""A decoder stack with a language-model head: what Llama and Persimmon share."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import PretrainedConfig

from ..layers.linear import Linear


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
