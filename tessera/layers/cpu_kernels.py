"""Which CPU kernels this machine can run, chosen per dtype with a fallback that works everywhere.

The oneDNN-packed linear (`linear.Linear`) goes through private `torch.ops.mkldnn` ops whose
support depends on the CPU: bfloat16 packing needs AVX-512 (bw/vl/dq) or AVX-NE-CONVERT, so it
raises on AVX2-only CPUs such as AMD Zen 3. Rather than guess from CPU flags, a probe packs a tiny
weight once per dtype and checks the packed matmul against `F.linear`; a dtype that fails runs on
plain `F.linear` (slower, never wrong).

`TESSERA_CPU_KERNELS=fallback` (default `auto`) forces `F.linear` on any machine; it is read at each
decision, so tests can set it. `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` emulates an
AVX2-only CPU on a newer one.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

ENV = "TESSERA_CPU_KERNELS"
MODES = ("auto", "fallback")
PACKED, FALLBACK = "onednn-packed", "fallback (F.linear)"


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


def linear_kernel(dtype: torch.dtype, mode: Optional[str] = None) -> str:
    """PACKED or FALLBACK: the kernel a CPU `Linear` of `dtype` runs after `pack_linears_for_cpu`."""
    if kernel_mode(mode) == "fallback" or dtype not in (torch.float32, torch.bfloat16):
        return FALLBACK
    return PACKED if onednn_packs(dtype) else FALLBACK


def describe_cpu_kernels(mode: Optional[str] = None) -> str:
    """One line for the start-up log, e.g.
    "CPU kernels (auto): capability AVX2, linear float32=onednn-packed bfloat16=fallback (F.linear)"."""
    dtypes = (torch.float32, torch.bfloat16)
    linear = " ".join(f"{str(d).removeprefix('torch.')}={linear_kernel(d, mode)}" for d in dtypes)
    return f"CPU kernels ({kernel_mode(mode)}): capability {torch.backends.cpu.get_cpu_capability()}, linear {linear}"
