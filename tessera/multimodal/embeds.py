"""Precomputed image embeddings sent over HTTP (vLLM's `image_embeds` content parts, behind the server's
`--enable-mm-embeds`): a tensor saved with `torch.save` and base64-encoded, [features, hidden] (or [1, features,
hidden]), loaded without running code (`weights_only`) and checked before it reaches the model: a floating dtype,
finite values, the language model's hidden size, and at most `max_rows` rows (a real image's worth)."""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InputError


@dataclass(frozen=True)
class ImageEmbedsRef:
    """An `image_embeds` part's payload, standing where an image URL would (chat_utils.parse_chat_media)."""

    data: Any


def decode_image_embeds(data: Any, hidden_size: int, max_rows: int, where: str = "image_embeds") -> torch.Tensor:
    """The checked [rows, hidden_size] float tensor of a base64 `torch.save` payload (an `image_embeds` part's, or a
    completion's `prompt_embeds`); InputError naming what is wrong otherwise."""
    if not isinstance(data, str):
        raise InputError(f"{where} must be a base64 string of a tensor saved with torch.save, "
                         f"got {type(data).__name__}.")  # fmt: skip
    tensor = _load(data, where)
    if tensor.ndim == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.ndim != 2 or not tensor.is_floating_point():
        raise InputError(f"{where} must be a float tensor [features, {hidden_size}], got {tensor.dtype} "
                         f"{tuple(tensor.shape)}.")  # fmt: skip
    if tensor.shape[1] != hidden_size:
        raise InputError(f"{where} has hidden size {tensor.shape[1]}; this model's is {hidden_size}.")
    if not 0 < tensor.shape[0] <= max_rows:
        raise InputError(f"{where} has {tensor.shape[0]} rows; it takes 1 to {max_rows} here.")
    if not torch.isfinite(tensor).all():
        raise InputError(f"{where} holds NaN or infinite values.")
    return tensor


def decode_image_embeds_part(data: Any, hidden_size: int, max_rows: int) -> Any:
    """An `image_embeds` part's value: a base64 tensor, or (for models that need them, vLLM's shape) a dict of base64
    tensors {"image_embeds": ..., "image_grid_thw": ...}: the checked embeddings, or a dict of them and the grid."""
    if not isinstance(data, dict):
        return decode_image_embeds(data, hidden_size, max_rows)
    unknown = sorted(set(data) - {"image_embeds", "image_grid_thw"})
    if unknown or "image_embeds" not in data:
        raise InputError(f"An image_embeds dict holds 'image_embeds' (and 'image_grid_thw'); got {sorted(data)}.")
    out = {"image_embeds": decode_image_embeds(data["image_embeds"], hidden_size, max_rows)}
    if "image_grid_thw" in data:
        grid = _load(data["image_grid_thw"], "image_embeds.image_grid_thw")
        if grid.numel() != 3 or grid.is_floating_point() or bool((grid <= 0).any()) or int(grid.prod()) > 1 << 24:
            raise InputError("image_embeds.image_grid_thw must be three positive integers (t, h, w).")
        out["image_grid_thw"] = grid.reshape(3).long()
    return out


def _load(data: Any, where: str) -> torch.Tensor:
    if not isinstance(data, str):
        raise InputError(f"{where} must be a base64 string of a tensor saved with torch.save.")
    try:
        tensor = torch.load(io.BytesIO(base64.b64decode(data, validate=True)), map_location="cpu", weights_only=True)
    except (binascii.Error, ValueError, RuntimeError, EOFError, OSError, pickle.UnpicklingError) as e:
        raise InputError(f"{where} is not a base64 tensor saved with torch.save ({type(e).__name__}).") from None
    if not isinstance(tensor, torch.Tensor):
        raise InputError(f"{where} holds a {type(tensor).__name__}, not a tensor.")
    return tensor


def encode_image_embeds(tensor: torch.Tensor) -> str:
    """A tensor as an `image_embeds` part carries it (what clients do: torch.save, then base64)."""
    buffer = io.BytesIO()
    torch.save(tensor.contiguous(), buffer)
    return base64.b64encode(buffer.getvalue()).decode()
