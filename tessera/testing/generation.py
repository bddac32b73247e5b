"""Greedy generation through the engine with the whole next-token distribution at every step, for
tests that compare the model code with Hugging Face transformers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tessera.sampling_params import SamplingParams


def greedy_logprobs(
    llm: Any, prompts: Sequence[Any], max_tokens: int, vocab_size: int
) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt (all sent in one `llm.generate` call, so the engine batches them): the greedy
    token ids (end-of-sequence ignored) and the log-probabilities of every token at each step,
    [max_tokens, vocab_size]; row 0 is the distribution after the prompt's last token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=vocab_size)
    results = []
    for output in llm.generate(list(prompts), params, use_tqdm=False):
        (completion,) = output.outputs
        steps = [[step[token] for token in range(vocab_size)] for step in completion.logprobs]
        results.append((completion.token_ids, torch.tensor(steps)))
    return results
