"""Rotary position embeddings: `get_rope(config, head_dim)` builds the one a model config asks for.

"Rotate half" layout (Llama, Qwen, Gemma, Persimmon, ...): the first `rotary_dim` features of each
head are split in two halves rotated pairwise; the rest pass through. Frequencies follow
transformers 5.x (`config.rope_parameters`, possibly nested per layer type as in Gemma 3) and fall
back to the older `rope_scaling` + `rope_theta` fields. The formulas are written out here, in HF's
op order so the fp32 tables are bit-identical (at position 1e5 one ulp of a frequency moves an angle
by ~1e-2), rather than called from transformers, whose init-function signatures change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from .mrope import MRopeLayout, MRotaryEmbedding, mrope_layout

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "proportional")


@dataclass(frozen=True)
class RopeSpec:
    """One layer type's rope, resolved from the config. `source` names the config key it came from."""

    rope_type: str
    theta: float
    head_dim: int
    rotary_dim: int  # int(head_dim * partial_rotary_factor)
    params: dict  # the rope-parameters dict (factor, beta_fast, original_max_position_embeddings, ...)
    max_position_embeddings: Optional[int]
    mrope: Optional[MRopeLayout]  # (mrope_section, interleaved) for M-RoPE, else None
    source: str


def get_rope(config: Any, head_dim: int, *, layer_type: Optional[str] = None) -> nn.Module:
    """The rotary embedding of `config` (for `layer_type` when rope_parameters is nested per layer
    type): `RotaryEmbedding`, or `MRotaryEmbedding` when the config asks for M-RoPE. Both have
    forward(positions, q [T, H, D], k [T, Hkv, D]) -> (q, k). Unsupported rope types raise."""
    spec = rope_spec(config, head_dim, layer_type=layer_type)
    rope = RotaryEmbedding(spec)
    if spec.mrope is None:
        return rope
    section, interleaved = spec.mrope
    return MRotaryEmbedding(rope, section, interleaved=interleaved)


def rope_spec(config: Any, head_dim: Optional[int], *, layer_type: Optional[str] = None) -> RopeSpec:
    """Reads and checks the rope fields: `rope_parameters` (flat, or nested per layer type), else
    `rope_scaling` + `rope_theta`; `partial_rotary_factor` from either. ValueError when unusable."""
    if not _has_rope_fields(config) and callable(getattr(config, "get_text_config", None)):
        config = config.get_text_config()  # a composite (vision-language) config: its text part's rope
    head_dim = head_dim or getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params, source = _rope_parameters(config, layer_type)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    rope_type = "default" if rope_type == "mrope" else rope_type  # Qwen2-VL's old name for it
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"Unsupported rope type {rope_type!r} in the {getattr(config, 'model_type', None) or 'model'} config "
            f"({source}); supported: {', '.join(SUPPORTED_ROPE_TYPES)} (and M-RoPE through mrope_section)"
        )
    default_theta = getattr(config, "default_theta", None)
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None)
    theta = theta or (default_theta if isinstance(default_theta, (int, float)) else 10000.0)
    factor = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    # "proportional" (Gemma 4's full layers): the first factor share of the frequencies turn, the rest are 0, over
    # the whole head; its exponents divide by head_dim, not by the rotated share
    rotary_dim = head_dim if rope_type == "proportional" else int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} (head_dim {head_dim} x partial_rotary_factor {factor}) must be even")
    spec = RopeSpec(
        rope_type, float(theta), head_dim, rotary_dim, params, getattr(config, "max_position_embeddings", None),
        mrope_layout(params, getattr(config, "model_type", None)), source,
    )  # fmt: skip
    for key in _REQUIRED[rope_type]:
        if _get(spec, key) is None:
            raise ValueError(f"rope type {rope_type!r} needs {key!r}, missing from the config ({source})")
    return spec


_REQUIRED = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),  # factor may come from max / original
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "proportional": (),
}


def _has_rope_fields(config: Any) -> bool:
    return any(getattr(config, key, None) for key in ("rope_parameters", "rope_scaling", "rope_theta"))


def _rope_parameters(config: Any, layer_type: Optional[str]) -> tuple[dict, str]:
    """A copy of the rope dict for this layer type and the config key it came from."""
    params, source = getattr(config, "rope_parameters", None), "rope_parameters"
    if not params:  # transformers 4.x style: rope_scaling (None for plain RoPE) + rope_theta
        params, source = getattr(config, "rope_scaling", None) or {}, "rope_scaling"
    if params and all(value is None or isinstance(value, dict) for value in params.values()):
        if layer_type is None:
            raise ValueError(f"The config nests {source} per layer type ({sorted(params)}): pass layer_type")
        if params.get(layer_type) is None:
            raise ValueError(f"No rope parameters for layer type {layer_type!r} in the config's {source}")
        params, source = params[layer_type], f"{source}[{layer_type!r}]"
    return dict(params), source


def _get(spec: RopeSpec, key: str) -> Any:
    if key == "max_position_embeddings":
        return spec.max_position_embeddings
    value = spec.params.get(key)
    if value is None and key == "original_max_position_embeddings":
        return spec.max_position_embeddings  # what transformers' standardisation fills in
    return value


def inverse_frequencies(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2] fp32 on CPU, attention scaling of cos/sin), as HF computes them at
    init ("dynamic": the table of the original context, max_position_embeddings)."""
    dim, base, p = spec.rotary_dim, spec.theta, spec.params
    exponents = _exponents(dim)  # [dim / 2]
    if spec.rope_type == "default":
        return 1.0 / (base**exponents), 1.0
    if spec.rope_type == "linear":
        return 1.0 / (base**exponents) / p["factor"], 1.0
    if spec.rope_type == "dynamic":
        factor, original = p["factor"], spec.max_position_embeddings  # HF's formula at seq_len = original
        base = spec.theta * ((factor * original / original) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base**exponents), 1.0
    if spec.rope_type == "proportional":
        turning = int((p.get("partial_rotary_factor") or 1.0) * dim // 2)  # HF: int(proportion * head_dim // 2)
        inv_freq = torch.zeros(dim // 2, device="cpu")  # built under torch.device("meta") too
        inv_freq[:turning] = 1.0 / (base ** exponents[:turning])
        return inv_freq / p.get("factor", 1.0), 1.0
    if spec.rope_type == "llama3":
        return _llama3(1.0 / (base**exponents), p, _get(spec, "original_max_position_embeddings")), 1.0
    return _yarn(spec, exponents)


def _exponents(dim: int) -> torch.Tensor:
    # on the CPU explicitly: models are built under `with torch.device("meta")`
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def _llama3(inv_freq: torch.Tensor, p: dict, old_context_len: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth ramp between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn(spec: RopeSpec, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by factor, keep high ones, ramp between; cos/sin scaled by
    attention_factor (or the mscale / mscale_all_dim rule)."""
    dim, base, p = spec.rotary_dim, spec.theta, spec.params
    original = _get(spec, "original_max_position_embeddings")
    factor = p.get("factor") or spec.max_position_embeddings / original  # DeepSeek-V3 leaves it to the ratio

    def mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in context
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base**exponents
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor, attention_factor


class RotaryEmbedding(nn.Module):
    """1-D RoPE: forward(positions [T], q [T, H, D], k [T, Hkv, D]) -> rotated q, k.

    Layers share one instance and one positions tensor per step, so cos/sin are computed once per
    positions tensor (the cache keys on the tensor object: pass a new one each step, never refill it).

    `RotaryEmbedding(config, head_dim)` is the plain text model's path and refuses M-RoPE configs;
    `get_rope` is the general one. rope types: default, linear, dynamic, yarn, llama3.

    "dynamic" (NTK): HF recomputes the frequencies for the current sequence length, which a paged
    engine with chunked prefill and mixed batches cannot reproduce. Here the token at position p is
    rotated with the frequencies HF computes for seq_len = max(p + 1, original context), the
    original context being `max_position_embeddings` as in HF's dynamic rule. This depends on the
    position only, never on batching or chunking, and equals HF for every position below the
    original context and for every decode query (HF's seq_len is then p + 1); a prompt longer than
    the original context differs from HF, which rotates all its tokens with one table.
    """

    def __init__(self, config: Any, head_dim: Optional[int] = None, *, layer_type: Optional[str] = None) -> None:
        super().__init__()
        if isinstance(config, RopeSpec):
            spec = config
        else:
            spec = rope_spec(config, head_dim, layer_type=layer_type)
            if spec.mrope is not None:  # never run 3-axis positions as 1-D, silently
                raise ValueError(
                    f"The model config asks for M-RoPE (mrope_section {list(spec.mrope[0])}): three-axis "
                    "positions this rotary embedding does not compute; this model cannot run that config."
                )
        self.spec = spec
        self.rope_type = spec.rope_type
        self.rotary_dim = spec.rotary_dim
        inv_freq, self.attention_scaling = inverse_frequencies(spec)  # CPU, HF's table; moved on use
        self._inv_freq = {torch.device("cpu"): inv_freq}  # not a buffer: no weight to load, any device
        self._cached: Optional[tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor]] = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """[rotary_dim / 2] fp32 on `device` (for "dynamic": the table of the original context)."""
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq[torch.device("cpu")].to(device)
        return self._inv_freq[device]

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] -> angles [T, rotary_dim / 2] (fp32)."""
        if self.rope_type == "dynamic":
            return positions.float()[:, None] * self._dynamic_inv_freq(positions)
        return positions.float()[:, None] * self.inv_freq(positions.device)[None, :]

    def _dynamic_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, rotary_dim / 2]: per token, HF's table at seq_len = max(p + 1, original context)."""
        original = self.spec.max_position_embeddings
        seq_lens = positions.long().cpu() + 1  # [T]
        tables = self.inv_freq(torch.device("cpu"))[None, :].repeat(len(seq_lens), 1)  # the original context's
        longer = seq_lens > original
        if longer.any():
            # HF's update passes seq_len as an int64 tensor, so its base is fp32 tensor math: same ops here
            factor, dim = self.spec.params["factor"], self.rotary_dim
            base = self.spec.theta * ((factor * seq_lens[longer] / original) - (factor - 1)) ** (dim / (dim - 2))
            tables[longer] = 1.0 / (base[:, None] ** _exponents(dim)[None, :])
        return tables.to(positions.device)

    def rotate(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        angles: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q, k by `angles(positions)` [T, rotary_dim / 2]; cos/sin cached per positions tensor."""
        cos, sin = self.tables(positions, q.dtype, angles)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def tables(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        angles: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) [T, 1, rotary_dim] in `dtype` for `apply_rotary` at `positions` (angles: `self.angles`
        unless given), computed once per positions tensor and dtype."""
        cached = self._cached
        if cached is None or cached[0] is not positions or cached[1] != dtype:
            emb = (angles or self.angles)(positions)  # [T, R / 2]: both halves of a head share a frequency
            cos = (emb.cos() * self.attention_scaling).to(dtype).repeat(1, 2)[:, None, :]  # [T, 1, R]
            sin = (emb.sin() * self.attention_scaling).to(dtype)
            signed_sin = torch.cat((-sin, sin), dim=-1)[:, None, :]  # see apply_rotary
            cached = self._cached = (positions, dtype, cos, signed_sin)
        return cached[2], cached[3]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, H, D], k [T, Hkv, D] -> rotated q, k (same shapes)."""
        return self.rotate(positions, q, k, self.angles)

    def extra_repr(self) -> str:
        return f"rope_type={self.rope_type}, rotary_dim={self.rotary_dim}, theta={self.spec.theta}"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., R] -> [..., R]: (x1, x2) -> (-x2, x1) over the two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated on its first R = cos.shape[-1] features: HF's `x * cos + rotate_half(x) * sin`,
    bit for bit, in fewer ops: rotate_half(x) * sin == roll(x, R / 2) * signed_sin, where signed_sin is
    (-sin, sin) over the two halves (negating is exact). cos, signed_sin broadcast to [..., R]."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + x.roll(rotary_dim // 2, dims=-1) * signed_sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + x_rot.roll(rotary_dim // 2, dims=-1) * signed_sin, x_pass), dim=-1)
