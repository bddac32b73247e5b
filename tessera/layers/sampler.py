"""From logits to tokens: greedy, or temperature with top-k / top-p / min-p, per request.

Each seeded request draws from its own generator, so its samples do not depend on what else
is in the batch. Constrained rows (structured outputs) come with a token bitmask: their disallowed
tokens get -inf before greedy or sampling; the other rows are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from ..sampling_params import SamplingParams


@dataclass
class TokenMask:
    """Allowed tokens of some rows of the batch: `bitmask[k]` (int32 words, bit j of word w allows
    token 32 * w + j, xgrammar's layout) is for row `rows[k]`; rows not listed are unconstrained."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32

    def allowed(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[len(rows), vocab_size] bool; tokens past the bitmask's end are not allowed."""
        bitmask = self.bitmask.to(device, non_blocking=True)
        shifts = torch.arange(32, device=device, dtype=torch.int32)
        bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
        if bits.shape[1] < vocab_size:
            bits = torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)
        return bits[:, :vocab_size]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Optional[dict[int, float]]]
    """Per row, if requested: token id -> log-probability for the sampled and the top tokens."""


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[Optional[torch.Generator]],
    token_mask: Optional[TokenMask] = None,
) -> SamplerOutput:
    """logits [B, vocab] (one row per request) -> one token per row; `token_mask` restricts some rows
    to their allowed tokens (the log-probabilities stay those of the model's distribution)."""
    logits = logits.float()
    scores = logits
    if token_mask is not None and token_mask.rows:
        scores = logits.clone()
        rows = torch.tensor(token_mask.rows, device=logits.device)
        allowed = token_mask.allowed(logits.shape[-1], logits.device)
        scores[rows] = scores[rows].masked_fill(~allowed, float("-inf"))
    tokens = scores.argmax(dim=-1)  # [B]; greedy rows keep it
    for row, (p, generator) in enumerate(zip(params, generators)):
        if not p.greedy:
            probs = _filtered_probs(scores[row] / p.temperature, p)
            if generator is not None and generator.device != probs.device:
                probs = probs.cpu()  # a seeded request's generator is a CPU one: the same samples on any device
            tokens[row] = int(torch.multinomial(probs, 1, generator=generator)[0])
    token_ids = tokens.tolist()
    logprobs: list[Optional[dict[int, float]]] = [None] * len(params)
    wanted = [row for row, p in enumerate(params) if p.logprobs is not None]
    if wanted:
        all_logprobs = torch.log_softmax(logits[wanted], dim=-1)  # of the model's distribution
        for k, row in enumerate(wanted):
            top = all_logprobs[k].topk(params[row].logprobs) if params[row].logprobs else None
            entry = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist()))
            entry[token_ids[row]] = float(all_logprobs[k, token_ids[row]])
            logprobs[row] = entry
    return SamplerOutput(token_ids, logprobs)


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[vocab] scaled logits -> probabilities after top-k, top-p and min-p."""
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep a token if the mass before it is below top_p (the most likely one always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()
