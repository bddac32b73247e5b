"""M-RoPE: the multimodal rotary embedding of Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

Every token has three position indices (temporal, height, width). Each rotary frequency is assigned
to one of the three axes and is rotated by that axis's index, so an image patch's angles encode its
(t, h, w) cell while a text token (same index on all three axes) gets plain RoPE.

- contiguous (Qwen2-VL, Qwen2.5-VL): `mrope_section` [s_t, s_h, s_w] splits the rotary_dim / 2
  frequencies into three consecutive bands: T T T .. H H .. W W ..
- interleaved (Qwen3-VL, `mrope_interleaved: true`): frequencies cycle T H W T H W .. while the H and
  W sections last, the tail is T (HF's `Qwen3VLTextRotaryEmbedding.recomposition_frequencies`).

This module only knows the M-RoPE layout; the frequencies, cos/sin cache and rotation come from the
1-D `RotaryEmbedding` it wraps (`get_rope` in rotary.py builds both; imports go rotary -> mrope).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Mapping, Optional, Protocol

import torch
from torch import nn


class RotaryFrequencies(Protocol):
    """What M-RoPE uses of the 1-D `RotaryEmbedding` it wraps (rotary.py; imports go rotary -> mrope)."""

    rope_type: str
    rotary_dim: int

    def inv_freq(self, device: torch.device) -> torch.Tensor: ...

    def angles(self, positions: torch.Tensor) -> torch.Tensor: ...

    def rotate(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, angles: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def tables(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        angles: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

# model_type -> (HF's default mrope_section, interleaved). HF's modeling classes fall back to these
# sections when the config has none (e.g. `Qwen2VLConfig()`), so such a config is still M-RoPE.
MROPE_MODEL_TYPES: dict[str, tuple[tuple[int, int, int], bool]] = {
    "qwen2_vl": ((16, 24, 24), False),
    "qwen2_vl_text": ((16, 24, 24), False),
    "qwen2_5_vl": ((16, 24, 24), False),
    "qwen2_5_vl_text": ((16, 24, 24), False),
    "qwen2_5_omni": ((16, 24, 24), False),
    "qwen2_5_omni_thinker": ((16, 24, 24), False),
    "qwen2_5_omni_text": ((16, 24, 24), False),
    "qwen3_vl": ((24, 20, 20), True),
    "qwen3_vl_text": ((24, 20, 20), True),
    "qwen3_vl_moe": ((24, 20, 20), True),
    "qwen3_vl_moe_text": ((24, 20, 20), True),
    "qwen3_5": ((11, 11, 10), True),
    "qwen3_5_text": ((11, 11, 10), True),
    "qwen3_5_moe": ((11, 11, 10), True),
    "qwen3_5_moe_text": ((11, 11, 10), True),
}

MRopeLayout = tuple[tuple[int, int, int], bool]  # (mrope_section, interleaved)


def mrope_layout(rope_params: Mapping[str, Any], model_type: Optional[str]) -> Optional[MRopeLayout]:
    """The M-RoPE layout one rope-parameters dict asks for, None for 1-D RoPE.

    M-RoPE when the dict has `mrope_section` or the old type name "mrope" (transformers renames it
    to "default" but keeps the section), or when the model type is an M-RoPE family (HF's default
    section then). Interleaved: as the family's HF class does (Qwen3-VL always, Qwen2-VL and
    Qwen2.5-VL never), else as `mrope_interleaved` says."""
    known = MROPE_MODEL_TYPES.get(model_type or "")
    if not _asks_for_mrope(rope_params) and known is None:
        return None
    section = rope_params.get("mrope_section")
    if section is None:
        if known is None:
            raise ValueError(
                f"The rope parameters ask for M-RoPE (type 'mrope') but give no mrope_section: {dict(rope_params)}"
            )
        section = known[0]
    if len(section) != 3:
        raise ValueError(f"mrope_section must have 3 entries (temporal, height, width), got {list(section)}")
    # the model's own HF class decides the layout when we know it (Qwen3-VL's always interleaves)
    interleaved = known[1] if known else bool(rope_params.get("mrope_interleaved", False))
    return (int(section[0]), int(section[1]), int(section[2])), interleaved


def uses_mrope(config: Any) -> bool:
    """Whether the model config (or its text config) asks for M-RoPE positions [3, T].

    The model factory refuses such a config for a model that does not declare M-RoPE support: a
    Qwen2-VL config run by a plain Qwen2 text model would silently get 1-D positions."""
    for cfg in _self_and_text_config(config):
        if getattr(cfg, "model_type", None) in MROPE_MODEL_TYPES:
            return True
        params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        nested = [p for p in params.values() if isinstance(p, Mapping)]  # per-layer-type dicts (Gemma 3 style)
        if any(_asks_for_mrope(p) for p in nested or [params]):
            return True
    return False


def _asks_for_mrope(rope_params: Mapping[str, Any]) -> bool:
    names = (rope_params.get("rope_type"), rope_params.get("type"))
    return rope_params.get("mrope_section") is not None or "mrope" in names


def _self_and_text_config(config: Any) -> list[Any]:
    configs = [config]
    text = getattr(config, "text_config", None)
    if text is None and callable(getattr(config, "get_text_config", None)):
        text = config.get_text_config()
    if text is not None and text is not config:
        configs.append(text)
    return configs


def mrope_axis_map(section: tuple[int, int, int], interleaved: bool, num_freqs: Optional[int] = None) -> torch.Tensor:
    """[num_freqs] (default sum(section)) long: the axis (0 = t, 1 = h, 2 = w) whose index rotates each
    frequency. Interleaved, frequency j takes h where j % 3 == 1 and j < 3 * section[1], w where j % 3 == 2
    and j < 3 * section[2], else t: HF's `apply_interleaved_mrope`, defined for any number of frequencies."""
    n = sum(section) if num_freqs is None else num_freqs  # CPU explicitly: built under `with torch.device("meta")`
    if not interleaved:  # T.. H.. W..
        return torch.repeat_interleave(torch.arange(3, device="cpu"), torch.tensor(section, device="cpu"))
    j = torch.arange(n, device="cpu")
    axis = torch.zeros(n, dtype=torch.long, device="cpu")  # T, except where the H / W slots of the cycle last
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axis


class MRotaryEmbedding(nn.Module):
    """M-RoPE over a 1-D rotary embedding's frequencies (any fixed-table rope type: default,
    linear, yarn, llama3, as HF allows). Build it with `get_rope(config, head_dim)`.

    forward(positions [3, T] (t, h, w) or [T] (text only: the index on all three axes), q [T, H, D],
    k [T, Hkv, D]) -> rotated q, k. cos/sin are cached per positions tensor like the 1-D rope's."""

    def __init__(self, rope: RotaryFrequencies, mrope_section: tuple[int, int, int], *, interleaved: bool) -> None:
        super().__init__()
        if rope.rope_type == "dynamic":  # its frequencies follow a sequence length: no meaning on 3 axes
            raise ValueError("Dynamic NTK rope scaling with M-RoPE (mrope_section) is not supported")
        if not interleaved and sum(mrope_section) != rope.rotary_dim // 2:  # interleaved: HF's map fits any width
            raise ValueError(
                f"mrope_section {list(mrope_section)} sums to {sum(mrope_section)}, but the rotary "
                f"embedding has rotary_dim / 2 = {rope.rotary_dim // 2} frequencies"
            )
        self.rope = rope
        self.rope_type = rope.rope_type
        self.rotary_dim = rope.rotary_dim
        self.mrope_section = tuple(mrope_section)
        self.interleaved = interleaved
        self._axis = mrope_axis_map(self.mrope_section, interleaved, rope.rotary_dim // 2)  # [rotary_dim / 2]

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [3, T] or [T] -> angles [T, rotary_dim / 2] (fp32)."""
        if positions.dim() == 1:  # same index on the three axes: every axis gives the plain angle
            return self.rope.angles(positions)
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(f"M-RoPE positions must be [3, T] or [T], got {tuple(positions.shape)}")
        inv_freq = self.rope.inv_freq(positions.device)  # [R/2]
        freqs = positions.float()[:, :, None] * inv_freq  # [3, T, R/2], HF's product exactly
        axis = self._axis.to(positions.device)[None, None, :].expand(1, positions.shape[1], -1)
        return freqs.gather(0, axis)[0]  # [T, R/2]: each frequency from its own axis

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope.rotate(positions, q, k, self.angles)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) [T, 1, rotary_dim] of the step, as `RotaryEmbedding.tables`."""
        return self.rope.tables(positions, dtype, self.angles)

    def extra_repr(self) -> str:
        return f"mrope_section={list(self.mrope_section)}, interleaved={self.interleaved}"
