"""One step's inputs to the language model, as every tensor-parallel rank runs them.

The driver (rank 0) turns the scheduler's output into `ModelInputs`: plain tensors and lists, with the
encoder outputs the step merges already cut to their rows, so a worker needs neither the requests, the
block manager nor the vision encoder. Rank 0 sends them to the workers; every rank then runs
`run_model` in lockstep (the parallel layers' collectives pair up) and gets the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ...layers.attention import AttentionMetadata, attention_metadata
from ...layers.lora import lora_rows
from ...layers.state_cache import copy_state_rows
from ...models.interfaces import supports_multimodal


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    """[T] token ids of the step's new tokens, all sequences flattened."""

    positions: torch.Tensor
    """[T], or [3, T] for M-RoPE models."""

    query_lens: list[int]
    """New tokens per sequence."""

    context_lens: list[int]
    """Tokens per sequence once this step's are in the cache."""

    block_tables: list[list[int]]

    sample_rows: list[int]
    """Rows of the step whose logits are sampled (each sequence's last token, where it reaches its end)."""

    is_multimodal: Optional[torch.Tensor] = None
    """[T] bool, True where an encoder output row replaces the token's embedding (multimodal models)."""

    mm_rows: Optional[list[torch.Tensor]] = None
    """The encoder output rows that go there, in order."""

    bidirectional_spans: Optional[list[list[tuple[int, int]]]] = None
    """Per sequence, spans that attend both ways (prefix-LM models)."""

    state_slots: Optional[list[int]] = None
    """Per sequence, its slot in the non-attention layers' state (hybrid models)."""

    state_restores: list[tuple[int, int]] = field(default_factory=list)
    """(snapshot row, slot): states copied before the step (a prefix-cache hit continues from its snapshot)."""

    embeds_mask: Optional[torch.Tensor] = None
    """[T] bool, True where a prompt_embeds row replaces the token's embedding."""

    embeds_rows: Optional[torch.Tensor] = None
    """Those rows [n, hidden], in order."""

    lora_ids: Optional[list[int]] = None
    """Per token row, the LoRA adapter id of its request (0: none); None when no request has one."""

    pool_rows: list[int] = field(default_factory=list)
    """Rows whose final hidden states the step returns (pooling requests' tokens)."""

    state_snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    """(sequence, offset, snapshot row): the stateful layers write the sequence's state after its first `offset`
    new tokens (a block boundary) to the row, for later prefix-cache hits."""


@torch.inference_mode()
def run_model(
    model: torch.nn.Module, inputs: ModelInputs, block_size: int, device: str
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Embeddings (merged with the encoder rows), the decoder over the paged KV cache; the logits
    [len(sample_rows), vocab] and the final hidden states [len(pool_rows), hidden] (each None when no row asks)."""
    metadata = AttentionMetadata.build(
        inputs.query_lens, inputs.context_lens, inputs.block_tables, block_size, device,
        bidirectional_spans=inputs.bidirectional_spans, state_slots=inputs.state_slots,
        state_snapshots=inputs.state_snapshots,
    )  # fmt: skip
    input_ids = inputs.input_ids.to(device)
    if supports_multimodal(model):
        mask = inputs.is_multimodal.to(device)
        inputs_embeds = model.get_input_embeddings(input_ids, inputs.mm_rows or None, is_multimodal=mask)
    else:
        inputs_embeds = model.get_input_embeddings(input_ids)
    if inputs.embeds_rows is not None:  # prompts given as embeddings (HF's inputs_embeds)
        inputs_embeds[inputs.embeds_mask.to(device)] = inputs.embeds_rows.to(device, inputs_embeds.dtype)
    copy_state_rows(model, inputs.state_restores)
    lora_ids = torch.tensor(inputs.lora_ids, device=device) if inputs.lora_ids else None
    with attention_metadata(metadata), lora_rows(lora_ids):
        ids = input_ids if getattr(model, "takes_input_ids_with_embeds", False) else None  # Gemma 4's PLE reads them
        hidden = model(ids, inputs.positions.to(device), inputs_embeds=inputs_embeds)
    pooled = hidden[inputs.pool_rows] if inputs.pool_rows else None
    if not inputs.sample_rows:
        return None, pooled
    return model.compute_logits(hidden[inputs.sample_rows]), pooled  # [num_sampling, vocab], [num_pool, hidden]
