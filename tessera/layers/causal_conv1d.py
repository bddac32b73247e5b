"""A causal depthwise convolution over each sequence's new tokens, its left context kept per sequence.

Gated DeltaNet (over q, k, v) and LFM2's short convolution run a depthwise conv1d of width K along the
sequence. Over a paged, flattened step each sequence brings some new tokens; the K - 1 inputs before them
are the sequence's conv state (zeros at its start), and after the step the state holds its last K - 1
inputs. Decode steps (one token per sequence) run as one batched product; prompt chunks one conv1d each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_state: torch.Tensor,
    slots: list[int],
    query_lens: list[int],
    snapshots: Mapping[int, Sequence[tuple[int, int]]] = {},  # noqa: B006  (read only)
) -> torch.Tensor:
    """x [T, C] (the step's new tokens, sequences one after the other, `query_lens` each), weight [C, K],
    conv_state [num_rows, C, K - 1] (sequence i's in row slots[i], updated) -> the convolution [T, C].
    `snapshots`: sequence i -> [(p, row)]: the state after its first p new tokens is also written to `row`."""
    out = torch.empty_like(x)
    width = weight.shape[1]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    decode = [i for i, n in enumerate(query_lens) if n == 1]
    if decode:  # one token each: [B, C, K] windows against the weights
        rows = torch.tensor([starts[i] for i in decode], device=x.device)
        index = torch.tensor([slots[i] for i in decode], device=x.device)
        window = torch.cat([conv_state[index].to(x.dtype), x[rows].unsqueeze(-1)], dim=-1)  # [B, C, K]
        y = (window * weight).sum(-1)
        out[rows] = y if bias is None else y + bias
        conv_state[index] = window[:, :, 1:].to(conv_state.dtype)
        for i in decode:
            for _, row in snapshots.get(i, ()):  # one token: the state after it
                conv_state[row] = conv_state[slots[i]]
    for i, n in enumerate(query_lens):
        if n == 1:
            continue
        window = torch.cat([conv_state[slots[i]].to(x.dtype), x[starts[i] : starts[i + 1]].t()], dim=-1)  # [C, K-1+n]
        out[starts[i] : starts[i + 1]] = F.conv1d(window[None], weight[:, None, :], bias, groups=weight.shape[0])[0].t()
        conv_state[slots[i]] = window[:, window.shape[1] - (width - 1) :].to(conv_state.dtype)
        for offset, row in snapshots.get(i, ()):
            conv_state[row] = window[:, offset : offset + width - 1].to(conv_state.dtype)
    return out
