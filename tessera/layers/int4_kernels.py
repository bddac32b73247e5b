"""Group-wise int4 weight-only linears on CPU where the native kernels are not built: torch's
`aten._weight_int4pack_mm_for_cpu` where a probe finds it exact for the activation dtype, else a de-quantized
weight and `F.linear`.

The op takes 4-bit weights packed in a nibble layout that depends on the CPU capability torch dispatches
to (`Int4Layout`, found at run time by packing a test pattern: `int4_layout`), with a scale and a zero per
group of inputs and output channel, w = (q - 8) * scale + zero. Layers keep one packed copy: the op's
layout where the op runs, a portable one otherwise (`pack_int4`, `unpack_int4`). `TESSERA_CPU_KERNELS=
fallback` forces the de-quantized path (`cpu_kernels.kernel_mode`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import native_kernels
from .cpu_kernels import DEQUANT, NATIVE, kernel_mode

INT4_MM = "int4-weight-pack-mm"

INT4_GROUP_SIZES = (32, 64, 128, 256)
"""Group sizes `aten._weight_int4pack_mm_for_cpu` takes (it also needs in_features a multiple of the group
size)."""
INT4_MM_N_ALIGN = 16
"""Its packing needs out_features a multiple of 16: other layers get zero rows (scale and zero 0) up to one,
and `int4_linear` drops their outputs."""

# Most input rows for which `aten._weight_int4pack_mm_for_cpu` beats de-quantizing the weight and running
# F.linear in float32, per activation dtype (measured on a 2-core AVX-512 CPU, 3072 x 576 and 576 x 1536
# weights in groups of 32: bfloat16 op 0.06 / 2.8 / 5.5 ms at 1 / 128 / 256 rows against 2.3 / 4.8 / 7.3 ms;
# de-quantizing costs ~1.5 ms of it). The op's x86 kernel is vectorized for bfloat16 only: float32 runs a
# scalar loop, about as slow as de-quantizing for 1 row and slower past it; float16 never wins.
INT4_MM_MAX_ROWS = {torch.bfloat16: 256, torch.float32: 1}


class Int4Layout(NamedTuple):
    """Where `aten._convert_weight_to_int4pack_for_cpu` puts each 4-bit value (it depends on the CPU
    capability torch dispatches to): output rows in blocks of `block` ([K, block / 2] bytes each, block after
    block, a shorter last block for the rest); in a full block byte j holds row j (low nibble) and row
    j + block / 2 (high nibble) when `split`, else rows 2j and 2j + 1, as in the last block always."""

    block: int
    split: bool


INT4_LAYOUTS = (Int4Layout(64, True), Int4Layout(32, True), Int4Layout(32, False), Int4Layout(16, False))
"""Layouts of torch 2.x: AVX-512, AVX2, the scalar kernel (DEFAULT), aarch64 NEON."""


def pack_int4(q: torch.Tensor, op_layout: bool) -> torch.Tensor:
    """4-bit values q (0..15, [out, in]) -> uint8 [out, in / 2]: in `aten._weight_int4pack_mm_for_cpu`'s
    layout (`op_layout`, see Int4Layout), else portable: byte j of a row holds inputs 2j (low nibble), 2j + 1."""
    if op_layout:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, layout: Optional[Int4Layout]) -> torch.Tensor:
    """uint8 [out, in / 2] packed by `pack_int4` (`layout` None: portable; else the op's, `int4_layout()`)
    -> the values, uint8 [out, in] (each nibble written once, straight to its place)."""
    rows, half = packed.shape
    out = torch.empty(rows, 2 * half, dtype=torch.uint8, device=packed.device)
    if layout is None:
        pairs = out.view(rows, half, 2)
        _split_nibbles(packed, pairs[..., 0], pairs[..., 1])
        return out
    flat, block = packed.reshape(-1), layout.block
    full = rows // block * block
    if full:  # [blocks, in, block / 2] bytes -> rows j and j + block / 2 (split) or 2j and 2j + 1 of each block
        data = flat[: full * half].view(full // block, 2 * half, block // 2)
        dest = (
            out[:full].view(full // block, 2, block // 2, -1)
            if layout.split
            else out[:full].view(full // block, block // 2, 2, -1)
        )
        low, high = (dest[:, 0], dest[:, 1]) if layout.split else (dest[:, :, 0], dest[:, :, 1])
        _split_nibbles(data, low.transpose(1, 2), high.transpose(1, 2))
    if full < rows:  # the last, shorter block: [in, rows / 2] bytes, rows 2j and 2j + 1
        dest = out[full:].view((rows - full) // 2, 2, -1)
        _split_nibbles(flat[full * half :].view(2 * half, -1), dest[:, 0].t(), dest[:, 1].t())
    return out


def _split_nibbles(data: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> None:
    torch.bitwise_and(data, 15, out=low)
    torch.bitwise_right_shift(data, 4, out=high)


@functools.cache
def int4_layout() -> Optional[Int4Layout]:
    """The layout `aten._convert_weight_to_int4pack_for_cpu` packs in on this CPU (the first of INT4_LAYOUTS that
    unpacks a test pattern), or None where the op fails or packs in none of them."""
    gen = torch.Generator().manual_seed(0)
    # 112 rows: a full block of 64 and a last one of 48, or 3 blocks of 32 and one of 16.
    q = torch.randint(0, 16, (112, 6), generator=gen, dtype=torch.uint8)
    try:
        packed = pack_int4(q, op_layout=True)
    except Exception:  # RuntimeError on an unsupported CPU; a build without the op fails otherwise
        return None
    if packed.dtype != torch.uint8 or packed.shape != (112, 3):
        return None
    return next((layout for layout in INT4_LAYOUTS if torch.equal(unpack_int4(packed, layout), q)), None)


def dequantize_int4(
    qweight: torch.Tensor, scales_and_zeros: torch.Tensor, layout: Optional[Int4Layout]
) -> torch.Tensor:
    """uint8 [out, in / 2] (`pack_int4`'s, in `layout`) with scales_and_zeros [in / group, out, 2] -> the float32
    weight [out, in], (q - 8) * scale + zero rounded once (a fused multiply-add, as torch's int4 kernels do; in
    float32 it is exact for bfloat16 and float16 scales and zeros of the magnitudes `quantize_int4` makes)."""
    q = unpack_int4(qweight, layout)
    rows, cols = q.shape
    groups = scales_and_zeros.shape[0]
    scale_zero = scales_and_zeros.float().permute(1, 0, 2).contiguous()  # [out, groups, 2]
    weight = q.view(rows, groups, cols // groups).float().sub_(8)
    return torch.addcmul(scale_zero[..., 1:], weight, scale_zero[..., :1], out=weight).view(rows, cols)


def int4_mm(x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ the int4 weight (packed in `int4_layout()`) -> [rows, out] by torch's CPU kernel (it takes
    the scales and zeros in x's dtype, in fp32 sums, rounding the outputs to x's dtype)."""
    group_size = x.shape[-1] // scales_and_zeros.shape[0]
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), qweight, group_size, scales_and_zeros.to(x.dtype))


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    bias: Optional[torch.Tensor],
    use_mm: bool,
    out_features: int,
) -> torch.Tensor:
    """x [rows, in] through a group-wise int4 weight-only linear: `int4_mm` for up to INT4_MM_MAX_ROWS rows
    when `use_mm` (then `qweight` is in the op's layout, its rows padded to INT4_MM_N_ALIGN), else F.linear on
    the de-quantized weight: in float32 with the output rounded to x's dtype, as the op rounds it (the two
    differ only in the order of fp32 sums), but for 16-bit inputs of more rows than the op takes, which run
    in their dtype. -> [rows, out_features]"""
    if use_mm and x.shape[0] <= INT4_MM_MAX_ROWS.get(x.dtype, 0):
        out = int4_mm(x, qweight, scales_and_zeros)
    else:
        weight = dequantize_int4(qweight, scales_and_zeros, int4_layout() if use_mm else None)
        if x.shape[0] > INT4_MM_MAX_ROWS.get(x.dtype, 0) and x.dtype in (torch.bfloat16, torch.float16):
            # prefill-sized: a 16-bit matmul (accumulating in float32) on the weight rounded to x's dtype, about
            # 1.5x faster than float32; the rounding (2^-9 of a weight) is ~40x below int4's own step
            out = F.linear(x, weight.to(x.dtype))
        else:  # the op's numerics: float32 products and sums, the output rounded once
            acc = torch.promote_types(x.dtype, torch.float32)  # float32 but for float64 inputs
            out = F.linear(x.to(acc), weight.to(acc)).to(x.dtype)
    if out.shape[-1] != out_features:  # padding rows
        out = out[:, :out_features].contiguous()
    return out if bias is None else out + bias


@functools.cache
def int4_mm_works(dtype: torch.dtype) -> bool:
    """Whether `aten._weight_int4pack_mm_for_cpu` runs on this CPU for activations of `dtype`, packs in a layout
    `unpack_int4` reads, and matches the de-quantized matmul."""
    layout = int4_layout()
    if layout is None:
        return False
    # Small integers and power-of-two scales: every weight, product and sum is exact in float32 (multiples
    # of 1/4 below 2^12), so the op and F.linear round the same values to `dtype` and must be equal.
    gen = torch.Generator().manual_seed(0)
    # Tails: 112 outputs (blocks of 64 or 32 and a shorter last one), 96 inputs (3 groups of 32, not a
    # multiple of 64), 5 rows (blocks of 4), x starting 1 element past an aligned allocation.
    q = torch.randint(0, 16, (112, 96), generator=gen, dtype=torch.uint8)
    scale = 2.0 ** torch.randint(-2, 2, (3, 112), generator=gen)
    zero = torch.randint(-12, 13, (3, 112), generator=gen) / 4
    scales_and_zeros = torch.stack((scale, zero), dim=-1).to(dtype)
    x = torch.randint(-2, 3, (5 * 96 + 1,), generator=gen).to(dtype)[1:].view(5, 96)
    try:
        with torch.no_grad():
            qweight = pack_int4(q, op_layout=True)
            if not torch.equal(unpack_int4(qweight, layout), q):
                return False
            expected = F.linear(x.float(), dequantize_int4(qweight, scales_and_zeros, layout)).to(dtype)
            return torch.equal(int4_mm(x, qweight, scales_and_zeros), expected)
    except Exception:  # RuntimeError for an unsupported dtype or ISA; a build without the op fails otherwise
        return False


def int4_kernel(dtype: torch.dtype, mode: Optional[str] = None) -> str:
    """NATIVE, INT4_MM or DEQUANT: the kernel of a CPU int4 weight-only `Linear` with activations of `dtype`: the
    native kernels' int16 dot products where they are built (`native_kernels.gemv_int4`), else torch's op (for
    layers whose shape it takes, `int4_mm_takes`), else de-quantizing."""
    if kernel_mode(mode) == "fallback":
        return DEQUANT
    if native_kernels.available():
        return NATIVE
    return INT4_MM if dtype in INT4_MM_MAX_ROWS and int4_mm_works(dtype) else DEQUANT


def int4_mm_takes(in_features: int, group_size: int) -> bool:
    """Whether `aten._weight_int4pack_mm_for_cpu` takes weights of `in_features` in groups of `group_size`
    (out_features: any, padded to INT4_MM_N_ALIGN)."""
    return group_size in INT4_GROUP_SIZES and in_features % group_size == 0
