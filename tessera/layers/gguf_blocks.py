"""A GGUF file's quantized blocks as the integers and scales the native int8 / int4 kernels take, value for value.

llama.cpp stores a quantized matrix row by row in blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) or 256 (K-quants)
weights, each with float16 scales (K-quants: sub-blocks of 16 or 32 with 6- or 8-bit scales times a float16).
Every one of these types is w = q * scale + zero per group of 16 or 32 weights, with q a small integer:

    type   q             scale       zero        group   held as (`quantization.keep_gguf_blocks`)
    Q8_0   -128..127     d           -           32      int8
    Q4_0   0..15         d           -8 d        32      int4, zero point 0
    Q4_1   0..15         d           m           32      int4, zero point 0
    Q5_0   -16..15       d           -           32      int8
    Q5_1   0..31         d           m           32      int8
    Q4_K   0..15         d * sc      -dmin * mn  32      int4, zero point 0
    Q5_K   0..31         d * sc      -dmin * mn  32      int8
    Q6_K   -32..31       d * sc      -           16      int8

d, m, dmin are the file's float16 values, so scale and zero are the file's exactly: float16 for the legacy
types (-8 d too), float32 for K-quants (a float16 times a 6- or 8-bit integer is exact in float32). So the
weights the kernels multiply are those llama.cpp de-quantizes, bit for bit; only x's rounding differs (the
kernels round x to int16 per group, llama.cpp to int8 per block).

Other types (Q2_K, Q3_K, IQ*, TQ*...) are not decoded here: the loader de-quantizes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


@dataclass
class QuantizedBlocks:
    """A [rows, cols] matrix as w = q * scale + zero, scale and zero per group of `group` consecutive columns."""

    q: torch.Tensor  # int8 [rows, cols]
    scale: torch.Tensor  # [rows, cols / group], float16 or float32
    zero: Optional[torch.Tensor]  # as scale, or None (w = q * scale)
    group: int

    @property
    def four_bit(self) -> bool:
        """Whether every q is in 0..15 with a zero: the int4 kernel's form (zero point 0)."""
        return self.zero is not None and bool(((self.q >= 0) & (self.q <= 15)).all())

    def dequantized(self) -> torch.Tensor:
        """The weights [rows, cols] in float64 (exact: products of a float32 and a small integer)."""
        expand = lambda t: t.double().repeat_interleave(self.group, dim=1)  # noqa: E731
        w = self.q.double() * expand(self.scale)
        return w if self.zero is None else w + expand(self.zero)

    def rows(self, index: torch.Tensor) -> "QuantizedBlocks":
        """These rows in the order of `index`."""
        zero = None if self.zero is None else self.zero[index]
        return QuantizedBlocks(self.q[index], self.scale[index], zero, self.group)


DECODED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def decode_blocks(type_name: str, raw: np.ndarray, cols: int) -> Optional[QuantizedBlocks]:
    """A tensor's bytes (uint8 [rows, bytes a row], as `gguf.GGUFReader` gives them) of GGUF type `type_name`
    -> its QuantizedBlocks; None for the types not in DECODED_TYPES."""
    if type_name not in DECODED_TYPES:
        return None
    data = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(raw.shape[0], -1)  # a copy: the file is read-only
    per_block = 256 if type_name.endswith("_K") else 32
    blocks = data.view(data.shape[0], cols // per_block, -1)  # [rows, blocks, bytes a block]
    q, scale, zero, group = _DECODERS[type_name](blocks)
    rows = data.shape[0]
    return QuantizedBlocks(
        q.reshape(rows, cols).to(torch.int8).contiguous(),
        scale.reshape(rows, -1).contiguous(),
        None if zero is None else zero.reshape(rows, -1).contiguous(),
        group,
    )


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [...] float16 (little-endian, as GGUF and x86)."""
    return b.contiguous().view(torch.float16)[..., 0]


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32]: the low nibbles are values 0..15, the high ones 16..31."""
    return torch.cat((qs & 15, qs >> 4), dim=-1).int()


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] its bits, bit j at j."""
    shifts = torch.arange(8, dtype=torch.int32)
    return ((qh.int()[..., None] >> shifts) & 1).flatten(-2)


def _q8_0(b):
    return b[..., 2:].contiguous().view(torch.int8), _f16(b[..., 0:2]), None, 32


def _q4_0(b):
    d = _f16(b[..., 0:2])
    return _nibbles(b[..., 2:18]), d, -8 * d, 32


def _q4_1(b):
    return _nibbles(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 32


def _q5_0(b):
    return (_nibbles(b[..., 6:22]) | _bits(b[..., 2:6]) << 4) - 16, _f16(b[..., 0:2]), None, 32


def _q5_1(b):
    return _nibbles(b[..., 8:24]) | _bits(b[..., 4:8]) << 4, _f16(b[..., 0:2]), _f16(b[..., 2:4]), 32


def _k_scales(b):
    """A Q4_K / Q5_K block's 8 sub-block scales and mins (6 bits each, packed in 12 bytes: llama.cpp's
    get_scale_min_k4) times d and dmin, in float32: [..., 8] each (the zero is -dmin * mn)."""
    d, dmin, s = _f16(b[..., 0:2]).float(), _f16(b[..., 2:4]).float(), b[..., 4:16].int()
    sc = torch.cat((s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6) << 4), dim=-1)
    mn = torch.cat((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6) << 4), dim=-1)
    return d[..., None] * sc, -(dmin[..., None] * mn)


def _q4_k(b):
    qs = b[..., 16:144].int().unflatten(-1, (4, 32))  # 4 chunks of 64 values: low nibbles, then high
    q = torch.stack((qs & 15, qs >> 4), dim=-2)  # [..., 4, 2, 32]
    return (q, *_k_scales(b), 32)


def _q5_k(b):
    qh = b[..., 16:48].int()  # bit 2c (2c + 1) of byte l: the fifth bit of value l of chunk c's low (high) half
    qs = b[..., 48:176].int().unflatten(-1, (4, 32))
    high = (qh[..., None, None, :] >> torch.arange(8, dtype=torch.int32).view(4, 2, 1)) & 1  # [..., 4, 2, 32]
    q = torch.stack((qs & 15, qs >> 4), dim=-2) | high << 4
    return (q, *_k_scales(b), 32)


def _q6_k(b):
    ql = b[..., 0:128].int().unflatten(-1, (2, 2, 32))  # halves of 128 values; in each, bytes l and l + 32
    qh = b[..., 128:192].int().unflatten(-1, (2, 1, 32))
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[..., 208:210]).float()
    # value 32 j + l of a half (j 0..3): nibble j // 2 of ql byte l + 32 (j % 2), bits 2 j, 2 j + 1 of qh byte l
    low = torch.stack((ql & 15, ql >> 4), dim=-3).flatten(-3, -2)  # [..., 2, j, 32]
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(4, 1)) & 3  # [..., 2, j, 32]
    q = (low | high << 4) - 32
    return q, d[..., None] * sc, None, 16


_DECODERS = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}  # fmt: skip


def concat_rows(parts: list[QuantizedBlocks]) -> Optional[QuantizedBlocks]:
    """Row blocks of one fused layer (q | k | v, gate | up) as one: groups of the smallest size (larger groups'
    scales repeated), float32 scales where the parts' dtypes differ, zeros where any part has them. None where
    the groups do not divide each other."""
    group = min(p.group for p in parts)
    if any(p.group % group for p in parts):
        return None
    dtype = parts[0].scale.dtype if len({p.scale.dtype for p in parts}) == 1 else torch.float32
    with_zero = any(p.zero is not None for p in parts)

    def expand(t: torch.Tensor, p: QuantizedBlocks) -> torch.Tensor:
        return t.to(dtype).repeat_interleave(p.group // group, dim=1)

    scales = [expand(p.scale, p) for p in parts]
    zeros = [expand(p.zero if p.zero is not None else torch.zeros_like(p.scale), p) for p in parts]
    return QuantizedBlocks(
        torch.cat([p.q for p in parts]), torch.cat(scales), torch.cat(zeros) if with_zero else None, group
    )
