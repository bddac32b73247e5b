"""Allocating the paged KV cache and binding it to a model's attention layers."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .attention import PagedAttention


def attention_layers(model: nn.Module) -> list[PagedAttention]:
    return [m for m in model.modules() if isinstance(m, PagedAttention)]


def kv_window(model: nn.Module) -> Optional[int]:
    """How many of a sequence's last keys any later query can see: the largest sliding window of the
    model's attention layers; None (all of them) if some layer has no window, or there is no layer."""
    windows = [a.sliding_window for a in attention_layers(model)]
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def kv_cache_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers (keys and values); a layer that reads another's cache costs none."""
    element_size = torch.empty(0, dtype=dtype).element_size()
    layers = [a for a in attention_layers(model) if not a.kv_source]
    return sum(2 * block_size * a.num_kv_heads * a.head_dim * element_size for a in layers)


def allocate_kv_cache(
    model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> None:
    """Give every attention layer a cache of `num_blocks` blocks of `block_size` tokens; a layer that reads
    another's cache (`kv_source`) gets that layer's tensors."""
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no PagedAttention layers")
    for layer in layers:
        if not layer.kv_source:
            shape = layer.cache_shape(num_blocks, block_size)
            layer.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.v_cache = torch.zeros(shape, dtype=dtype, device=device)
    for layer in layers:
        if layer.kv_source:
            (source,) = layer.kv_source
            layer.k_cache, layer.v_cache = source.k_cache, source.v_cache
