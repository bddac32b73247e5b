"""Which CPU kernels this machine can run, chosen per dtype with a fallback that works everywhere.

The oneDNN-packed linear (`linear.Linear`) goes through private `torch.ops.mkldnn` ops whose
support depends on the CPU: bfloat16 packing needs AVX-512 (bw/vl/dq) or AVX-NE-CONVERT, so it
raises on AVX2-only CPUs such as AMD Zen 3. Rather than guess from CPU flags, a probe packs a tiny
weight once per dtype and checks the packed matmul against `F.linear`; a dtype that fails runs on
plain `F.linear` (slower, never wrong).

Int8 and int4 weight-only linears (`quantization`) run the native kernels' int16 dot products where they are
built, else a de-quantized weight and `F.linear` (int4 first tries torch's op: `int4_kernels`).

Float32 linears, and 16-bit ones where oneDNN cannot pack them, run Tessera's own weight-streaming kernel
(`native_kernels`, built from `csrc/` at setup) where it is built (`linear_kernel` says why per dtype).

`TESSERA_CPU_KERNELS=fallback` (default `auto`) forces `F.linear` (de-quantizing int8/int4 weights) on any
machine; it is read at each decision, so tests can set it. `ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2` emulates an AVX2-only CPU on a newer one.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

from . import native_kernels

ENV = "TESSERA_CPU_KERNELS"
MODES = ("auto", "fallback")
PACKED, FALLBACK = "onednn-packed", "fallback (F.linear)"
NATIVE = "native"  # tessera/layers/csrc's weight-streaming kernel (native_kernels.gemv)
DEQUANT = "fallback (de-quantize + F.linear)"


def pack_weight(weight: torch.Tensor, batch_size_hint: int) -> torch.Tensor:
    """[out, in] dense weight -> oneDNN blocked layout (an opaque tensor for `packed_linear`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_size_hint)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [rows, in] @ packed weight -> [rows, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def kernel_mode(mode: Optional[str] = None) -> str:
    """`mode` if given, else $TESSERA_CPU_KERNELS, else "auto"."""
    mode = (mode or os.environ.get(ENV) or "auto").lower()
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether the packed linear runs on this CPU for `dtype` and matches F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    # Small integers: every product and sum is exact in bfloat16, so the results must be equal.
    gen = torch.Generator().manual_seed(0)
    weight, bias, x = (torch.randint(-2, 3, shape, generator=gen).to(dtype) for shape in ((8, 16), (8,), (3, 16)))
    try:
        with torch.no_grad():
            return torch.equal(packed_linear(x, pack_weight(weight, 16), bias), F.linear(x, weight, bias))
    except Exception:  # RuntimeError for an unsupported ISA; a build without the op fails otherwise
        return False


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [out, in] x scale [out, groups] (one per group of in / groups inputs) -> the weight in `dtype` (each
    product rounded once to `dtype`)."""
    rows, cols = qweight.shape
    grouped = qweight.view(rows, scale.shape[1], -1).to(dtype) * scale.to(dtype)[..., None]
    return grouped.view(rows, cols)


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """x [rows, in] through an int8 weight-only linear where the native kernel does not run: F.linear on the
    de-quantized weight."""
    return F.linear(x, dequantize_int8(qweight, scale, x.dtype), bias)


def int8_kernel(mode: Optional[str] = None) -> str:
    """NATIVE or DEQUANT: the kernel of a CPU int8 weight-only `Linear` (native: int16 dot products, `native_kernels.
    gemv_int8`; for layers of an even in_features)."""
    return NATIVE if kernel_mode(mode) == "auto" and native_kernels.available() else DEQUANT


def linear_kernel(dtype: torch.dtype, mode: Optional[str] = None) -> str:
    """NATIVE, PACKED or FALLBACK: the kernel a CPU `Linear` of `dtype` runs after `pack_linears_for_cpu`.

    Measured (benchmarks/bench_gemv.py, 2-core Zen 4, and the same forced to AVX2): the native kernel reads
    float32 weights 1.2-1.9x faster than oneDNN's packed linear for 1-64 rows (0.9x at 256, prefill); 16-bit
    weights it widens in registers, 1.2-4.6x F.linear's rate at every row count where oneDNN cannot pack them
    (AVX2-only CPUs); where oneDNN packs bfloat16 its bf16 dot products beat the widening from 8 rows on
    (0.5-0.9x), so bfloat16 runs the native kernel there only where it has bf16 dot products too (AVX512-BF16),
    and not where oneDNN has AMX tiles (Intel since Sapphire Rapids: 5x the native rate at 256 rows), else
    oneDNN."""
    if kernel_mode(mode) == "fallback" or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return FALLBACK
    bf16_dot = dtype == torch.bfloat16 and native_kernels.has_bf16_dot() and not native_kernels.has_amx()
    if native_kernels.available() and (dtype == torch.float32 or not onednn_packs(dtype) or bf16_dot):
        return NATIVE
    return PACKED if onednn_packs(dtype) else FALLBACK


def describe_cpu_kernels(mode: Optional[str] = None) -> str:
    """One line for the start-up log, e.g.
    "CPU kernels (auto): capability AVX2, linear float32=onednn-packed bfloat16=fallback (F.linear)"."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    linear = " ".join(f"{str(d).removeprefix('torch.')}={linear_kernel(d, mode)}" for d in dtypes)
    native = native_kernels.describe()
    return (
        f"CPU kernels ({kernel_mode(mode)}): capability {torch.backends.cpu.get_cpu_capability()}, linear {linear}; "
        f"native: {native}"
    )
