"""Helpers shared by model files (as in vLLM's `model_executor.models.utils`)."""

from __future__ import annotations

from typing import Any, Union

import torch

MultiModalEmbeddings = Union[torch.Tensor, list[torch.Tensor], tuple[torch.Tensor, ...]]
"""A (num_items, feature_size, hidden) tensor or one (feature_size, hidden) tensor per item."""


def flatten_embeddings(embeddings: MultiModalEmbeddings) -> torch.Tensor:
    """Item embeddings in item order as one [num_rows, hidden] tensor."""
    if isinstance(embeddings, torch.Tensor):
        return embeddings.reshape(-1, embeddings.shape[-1])
    return torch.cat([e.reshape(-1, e.shape[-1]) for e in embeddings])


def merge_multimodal_embeddings(
    input_ids: torch.Tensor,
    inputs_embeds: torch.Tensor,
    multimodal_embeddings: MultiModalEmbeddings,
    placeholder_token_id: Union[int, list[int]],
) -> torch.Tensor:
    """Write the item embeddings, in order, over the positions holding a placeholder token.

    input_ids [T]; inputs_embeds [T, hidden] (updated in place and returned).
    """
    ids = torch.as_tensor(placeholder_token_id, device=input_ids.device)
    return merge_multimodal_embeddings_by_mask(inputs_embeds, multimodal_embeddings, torch.isin(input_ids, ids))


def merge_multimodal_embeddings_by_mask(
    inputs_embeds: torch.Tensor, multimodal_embeddings: MultiModalEmbeddings, is_multimodal: torch.Tensor
) -> torch.Tensor:
    """Write the item embeddings, in order, over the positions where `is_multimodal` [T] is True."""
    if is_multimodal.dtype != torch.bool:  # an int mask would index rows instead of selecting them
        raise TypeError(f"is_multimodal must be a bool mask, got {is_multimodal.dtype}")
    num_rows = sum(e.reshape(-1, e.shape[-1]).shape[0] for e in multimodal_embeddings)
    num_placeholders = int(is_multimodal.sum())
    if num_rows != num_placeholders:
        raise ValueError(f"Attempted to assign {num_rows} multimodal embeddings to {num_placeholders} placeholders")
    if num_rows == 0:
        return inputs_embeds
    flat = flatten_embeddings(multimodal_embeddings)
    inputs_embeds[is_multimodal] = flat.to(device=inputs_embeds.device, dtype=inputs_embeds.dtype)
    return inputs_embeds


def stack_images(pixel_values: Any, name: str, what: str = "images") -> torch.Tensor:
    """A batch's pixel values as one [N, channels, height, width] tensor: a tensor as it is, or a list of
    per-item tensors (each [..., C, H, W]) concatenated; anything else is a ValueError naming `name`."""
    if isinstance(pixel_values, (list, tuple)):
        pixel_values = torch.cat([torch.as_tensor(p).reshape(-1, *p.shape[-3:]) for p in pixel_values])
    if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 4:
        raise ValueError(f"{name} must be ({what}, channels, height, width)")
    return pixel_values


def module_dtype_device(module: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    """Where a model part runs: the dtype and device of its first parameter."""
    param = next(module.parameters())
    return param.dtype, param.device
