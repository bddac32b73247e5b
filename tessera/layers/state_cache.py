"""The per-sequence state of non-attention layers (hybrid models), beside the paged KV cache.

A recurrent or convolutional layer (Gated DeltaNet, LFM2's short convolution) keeps a fixed-size state
per sequence instead of keys and values that grow with it: a convolution's last inputs, a recurrent
matrix. Such a layer is a `StatefulLayer`: it says the shapes and dtypes of its state per sequence
(`state_specs`), and the engine gives it tensors of `num_slots` rows each (`allocate_state_cache`), one row
(slot) per running sequence. Which slot a sequence uses comes with each step's `AttentionMetadata`
(`state_slots`), and a sequence whose step starts at token 0 (a new prompt, or one recomputed after
preemption) starts from a zero state: the layer zeroes its rows (`zero_fresh_states`)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .attention_metadata import AttentionMetadata

StateSpec = tuple[tuple[int, ...], Optional[torch.dtype]]
"""One state tensor per sequence: (shape, dtype; None: the model's dtype)."""


class StatefulLayer(nn.Module):
    """A layer with per-sequence state. Subclasses implement `state_specs`; their tensors are bound by
    `allocate_state_cache` as attributes of the same names, [num_slots, *shape]."""

    def state_specs(self) -> dict[str, StateSpec]:
        raise NotImplementedError

    def states(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.state_specs()]

    def zero_fresh_states(self, metadata: AttentionMetadata) -> list[int]:
        """Zero the states of the step's sequences that start at token 0; returns every sequence's slot."""
        slots = metadata.state_slots
        if slots is None:
            raise RuntimeError(f"{type(self).__name__} needs state slots in the step's metadata (a hybrid model)")
        fresh = [slot for slot, q, c in zip(slots, metadata.query_lens, metadata.context_lens) if q == c]
        if fresh:
            index = torch.tensor(fresh, dtype=torch.long, device=self.states()[0].device)
            for state in self.states():
                state.index_fill_(0, index, 0)
        return slots


def stateful_layers(model: nn.Module) -> list[StatefulLayer]:
    return [m for m in model.modules() if isinstance(m, StatefulLayer)]


def state_bytes_per_slot(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes one sequence's state costs across all layers (0 for an attention-only model)."""
    total = 0
    for layer in stateful_layers(model):
        for shape, state_dtype in layer.state_specs().values():
            numel = 1
            for size in shape:
                numel *= size
            total += numel * torch.empty(0, dtype=state_dtype or dtype).element_size()
    return total


def allocate_state_cache(model: nn.Module, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
    """Give every stateful layer its state tensors, [num_slots, *shape] each, zeroed."""
    for layer in stateful_layers(model):
        for name, (shape, state_dtype) in layer.state_specs().items():
            setattr(layer, name, torch.zeros((num_slots, *shape), dtype=state_dtype or dtype, device=device))


def copy_state_rows(model: nn.Module, pairs: list[tuple[int, int]]) -> None:
    """For each (source, destination) row pair, every stateful layer's states copied from one row to the other."""
    if not pairs:
        return
    for layer in stateful_layers(model):
        for state in layer.states():
            source = torch.tensor([src for src, _ in pairs], device=state.device)
            state.index_copy_(0, torch.tensor([dst for _, dst in pairs], device=state.device), state[source])
