"""The gated delta rule (Gated DeltaNet's linear attention) in plain torch, fp32, as HF's torch reference.

Per value head, a state S [dk, dv] decays and is corrected towards each new key/value pair:

    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

(q and k L2-normalised, q scaled by dk^-0.5, beta_t = sigmoid(b_t), g_t <= 0 the log decay). Decode runs
the recurrence one token per sequence, batched over sequences (`recurrent_step`); a prompt chunk runs the
chunked form (`chunked`: chunks of 64 tokens, the intra-chunk part as triangular solves, the state carried
between chunks), as transformers' `torch_chunk_gated_delta_rule` computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state [B, H, dk, dv] (all fp32)
    -> (output [B, H, dv], the new state)."""
    state = state * g.exp()[..., None, None]
    memory = (state * k[..., None]).sum(dim=-2)  # [B, H, dv]: what the state recalls for k
    delta = (v - memory) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens of one sequence: q, k [H, T, dk], v [H, T, dv], g, beta [H, T], state [H, dk, dv] (fp32)
    -> (output [H, T, dv], the state after the last token)."""
    num_tokens = q.shape[1]
    pad = -num_tokens % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    heads, length = q.shape[0], q.shape[1]
    num_chunks = length // chunk_size
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(heads, num_chunks, chunk_size, -1) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(heads, num_chunks, chunk_size).cumsum(dim=-1)  # [H, N, C]: log decay from the chunk start
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [H, N, C, C]
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # unit lower-triangular system (diagonal taken as 1)
    attn = (q @ k.transpose(-1, -2)) * pairwise  # intra-chunk scores, diagonal included
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    out = torch.empty_like(values)
    for i in range(num_chunks):
        v_new = values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + attn[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, length, -1)[:, :num_tokens], state
