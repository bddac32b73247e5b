"""Pooling a prompt's final hidden states into what a pooling request returns (see tessera/pooling_params.py)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..pooling_params import PoolerConfig, PoolingParams


def pool(hidden: torch.Tensor, config: PoolerConfig, params: Optional[PoolingParams] = None) -> torch.Tensor:
    """hidden [n, H] (every prompt token's final hidden state, in order) -> [H'] (LAST, MEAN, CLS) or [n, H'] (ALL),
    float32: cut to the request's `dimensions`, then L2-normalized if the request (else the config) says so."""
    params = params or PoolingParams()
    kind = config.pooling_type
    out = hidden[-1] if kind == "LAST" else hidden[0] if kind == "CLS" else hidden
    out = out.float().mean(dim=0) if kind == "MEAN" else out.float()
    if params.dimensions is not None:
        if params.dimensions > out.shape[-1]:
            raise ValueError(f"dimensions {params.dimensions} exceeds the model's {out.shape[-1]}")
        out = out[..., : params.dimensions]
    normalize = config.normalize if params.normalize is None else params.normalize
    return F.normalize(out, dim=-1) if normalize else out


def similarity(query: torch.Tensor, document: torch.Tensor) -> float:
    """How well `document` answers `query`: the cosine of two vectors; for multi-vector embeddings ([n, D] and
    [m, D], pooling "ALL"), late interaction (ColBERT's MaxSim): each query vector's best dot product with a
    document vector, summed over the query."""
    if query.dim() == 1 and document.dim() == 1:
        return float(F.cosine_similarity(query.float(), document.float(), dim=0))
    if query.dim() == 2 and document.dim() == 2:
        return float((query.float() @ document.float().T).max(dim=1).values.sum())
    raise ValueError("Both sides of a score must be single vectors or both multi-vector embeddings")
