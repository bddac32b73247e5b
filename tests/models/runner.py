"""A minimal test driver for the model code: prefill and decode sequences over a paged KV cache.

It does what the engine's model runner does, without scheduling: blocks are handed out in order,
embeddings merged by the placeholders' is_embed masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tessera.layers.attention import AttentionMetadata, attention_metadata
from tessera.layers.kv_cache import allocate_kv_cache
from tessera.multimodal.inputs import MultiModalInputs


@dataclass
class Sequence:
    inputs: MultiModalInputs
    token_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.inputs["prompt_token_ids"])


class Runner:
    def __init__(self, model: torch.nn.Module, *, block_size: int = 4, num_blocks: int = 512) -> None:
        self.model, self.block_size = model, block_size
        dtype = next(model.get_language_model().parameters()).dtype
        allocate_kv_cache(model, num_blocks, block_size, dtype)
        self.free_blocks = list(range(num_blocks))

    def _reserve(self, seq: Sequence, length: int) -> None:
        while len(seq.blocks) * self.block_size < length:
            seq.blocks.append(self.free_blocks.pop(0))

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], num_new: list[int]) -> list[torch.Tensor]:
        """Run the next `num_new[i]` uncached tokens of each sequence in one forward; returns
        each sequence's logits for those tokens ([num_new, vocab])."""
        ids, positions, is_mm, embeds = [], [], [], []
        for seq, n in zip(seqs, num_new):
            start = seq.num_cached
            self._reserve(seq, start + n)
            ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            mask = torch.zeros(len(seq.token_ids), dtype=torch.bool)
            for placeholder in [p for ps in seq.inputs["mm_placeholders"].values() for p in ps]:
                span = slice(placeholder.offset, placeholder.offset + placeholder.length)
                mask[span] = True if placeholder.is_embed is None else placeholder.is_embed
            is_mm.append(mask[start : start + n])
            if start == 0 and seq.inputs["mm_kwargs"]:  # whole prompts only: items are embedded at once
                embeds += list(self.model.get_multimodal_embeddings(**seq.inputs["mm_kwargs"]))
        metadata = AttentionMetadata.build(
            num_new,
            [s.num_cached + n for s, n in zip(seqs, num_new)],
            [s.blocks for s in seqs],
            self.block_size,
        )
        input_ids = torch.tensor(ids)
        inputs_embeds = self.model.get_input_embeddings(input_ids, embeds or None, is_multimodal=torch.cat(is_mm))
        with attention_metadata(metadata):
            hidden = self.model(None, torch.tensor(positions), inputs_embeds=inputs_embeds)
        logits = self.model.compute_logits(hidden)
        for seq, n in zip(seqs, num_new):
            seq.num_cached += n
        return list(logits.split(num_new))

    def prefill(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        return self.step(seqs, [len(s.token_ids) for s in seqs])

    def greedy(self, seq: Sequence, num_tokens: int) -> list[int]:
        return self.greedy_with_logits(seq, num_tokens)[0]

    def greedy_with_logits(self, seq: Sequence, num_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens, and the logits of each decode step ([num_tokens - 1, vocab])."""
        logits = self.prefill([seq])[0][-1]
        tokens, decode_logits = [], []
        for i in range(num_tokens):
            tokens.append(int(logits.argmax()))
            seq.token_ids.append(tokens[-1])
            if i < num_tokens - 1:
                logits = self.step([seq], [1])[0][-1]
                decode_logits.append(logits)
        return tokens, torch.stack(decode_logits)
