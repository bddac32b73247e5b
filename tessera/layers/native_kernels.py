"""Tessera's native CPU kernels (`csrc/`), built from source with the system compiler and registered as
torch ops (`torch.ops.tessera.*`).

`make setup` builds them (`python -m tessera.layers.native_kernels`) into the environment
(`<prefix>/share/tessera/torch_extensions`, or $TESSERA_CACHE_DIR); later loads reuse that build (torch's
cpp_extension rebuilds only when a source changes). If the build or the CPU check fails, `available()` is
False, the log says why once, and the callers keep the eager PyTorch path.

The ISA is the CPU's: AVX-512 (F, BW, VL) where present, else AVX2 + FMA + F16C; below that, no native
kernel. `ATEN_CPU_CAPABILITY=avx2` (as `make test` sets for the layer tests) forces the AVX2 path on a newer
CPU.

What is here: the weight-streaming products the engine's linears run, each over weights re-packed once at
load in blocks of 16 outputs (`gemv`: float32 / 16-bit weights, `gemv_bf16dot`: AVX512-BF16 pairs, `gemv_int8` /
`gemv_int4`: integer dot products; `benchmarks/bench_gemv.py` measures them), and `DecodeLayer`, a Llama-shaped
decoder layer's decode step as one call (`models/native_decode.py`). The `gemv*` functions check their
arguments; `linear*` are the engine's unchecked hot paths.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("gemv.cpp", "gemv_quant.cpp", "decode_layer.cpp")]
ISA_AVX2, ISA_AVX512 = 1, 2
ISA_NAMES = {ISA_AVX2: "avx2", ISA_AVX512: "avx512"}
BLOCK = 16
"""Outputs per block of the packed weight layout ([N / 16, K, 16])."""


class DecodeKind(enum.IntEnum):
    """How a linear's weight is held, as csrc/decode_layer.cpp's `Kind` reads it."""

    DENSE = 0  # F.linear on the dense weight
    NATIVE = 1  # `gemv`
    BF16_DOT = 2  # `gemv_bf16dot`
    INT8 = 3  # `gemv_int8`
    INT4 = 4  # `gemv_int4`
    ONEDNN = 5  # oneDNN's packed linear


def build_directory() -> Path:
    root = os.environ.get("TESSERA_CACHE_DIR") or os.path.join(sys.prefix, "share", "tessera")
    return Path(root) / "torch_extensions"


@functools.cache
def _load() -> Optional[str]:
    """Build (if needed) and load the library; None, or why it could not be."""
    try:
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        folder = build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name="tessera_cpu_kernels", sources=[str(s) for s in SOURCES], build_directory=str(folder),
            extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
        )  # fmt: skip
        return None
    except Exception as e:  # no compiler, a failed build...: the eager path runs
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH: the system's, else the `ninja` package's (a venv's python run
    without activating the venv does not have its bin/ on PATH)."""
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass


def cpu_isa() -> Optional[int]:
    """The best native ISA this CPU runs (ATEN_CPU_CAPABILITY=avx2 caps it at AVX2), else None."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "fma", "f16c"} <= flags and capability not in ("avx2", "default"):
        return ISA_AVX512
    if {"avx2", "fma", "f16c"} <= flags and capability != "default":
        return ISA_AVX2
    return None


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def available() -> bool:
    """Whether the native kernels run here: built, loaded, and an ISA they have (logged once, with why not)."""
    return _status()[0]


@functools.cache
def _status() -> tuple[bool, str]:
    if cpu_isa() is None:
        status = (False, "no native kernels: this CPU has no AVX2 + FMA + F16C")
    else:
        error = _load()
        status = (error is None, "native kernels: " + ("loaded" if error is None else f"not built ({error})"))
    (logger.info if status[0] else logger.warning)("%s", status[1])
    return status


def describe() -> str:
    isa = cpu_isa()
    return f"{ISA_NAMES[isa]}" if available() and isa is not None else _status()[1]


def pack_gemv_weight(weight: torch.Tensor) -> torch.Tensor:
    """A dense [N, K] weight -> the layout `gemv` streams: [ceil(N / 16), K, 16], the outputs of each block
    of 16 side by side at each k (rows past N are zero)."""
    return _blocks(weight.detach()).transpose(1, 2).contiguous()


def has_bf16_dot() -> bool:
    """Whether this CPU multiplies bfloat16 pairs (AVX512-BF16: Zen 4, Intel since Cooper Lake) on the AVX-512
    path (ATEN_CPU_CAPABILITY=avx2 turns it off with the rest of AVX-512)."""
    return cpu_isa() == ISA_AVX512 and "avx512_bf16" in _cpu_flags() and available()


def has_amx() -> bool:
    """Whether this CPU has AMX bfloat16 tiles (Intel since Sapphire Rapids), which oneDNN's bfloat16 kernels
    use: measured on one, they beat the native bf16 dot products from 4 rows on (5x at 256), so bfloat16 stays
    on oneDNN there until the native kernels have AMX tiles."""
    return "amx_bf16" in _cpu_flags()


def pack_bf16dot_weight(weight: torch.Tensor) -> torch.Tensor:
    """A dense bfloat16 [N, K] weight -> the layout `gemv_bf16dot` streams: [ceil(N / 16), ceil(K / 2), 16, 2],
    at each pair of k the 16 outputs' two weights side by side (zeros past N and K)."""
    k = weight.shape[1]
    even = torch.nn.functional.pad(weight.detach().to(torch.bfloat16), (0, k % 2))
    return _blocks(even).view(-1, BLOCK, (k + 1) // 2, 2).permute(0, 2, 1, 3).contiguous()


def gemv_bf16dot(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (rounded to bfloat16) @ a `pack_bf16dot_weight` weight of `n` outputs (+ bias) -> [M, n] in x's
    dtype: pairs of bfloat16 products added into float32 (AVX512-BF16), as oneDNN's bfloat16 kernels do."""
    pairs = (x.shape[-1] + 1) // 2 if x.dim() == 2 else -1
    _check(x, packed, n, bias, (-(-n // BLOCK), pairs, BLOCK, 2), (torch.bfloat16,))
    if not has_bf16_dot():
        raise RuntimeError("gemv_bf16dot needs AVX512-BF16, which this CPU (or ATEN_CPU_CAPABILITY) does not give")
    return torch.ops.tessera.gemv_bf16dot(x, packed, n, bias)


def _check(x, packed, n, bias, shape, dtypes) -> None:
    """Refuse here, in Python, what the op would refuse: a C++ exception does not cross every build of torch
    (one that a different compiler built crashed on it)."""
    if x.dim() != 2 or tuple(packed.shape) != shape or packed.dtype not in dtypes or x.device.type != "cpu":
        raise ValueError(
            f"native kernels: x [M, K] on the CPU and a packed weight {list(shape)} of {', '.join(map(str, dtypes))} "
            f"for {n} outputs expected, got x {list(x.shape)} and a weight {list(packed.shape)} of {packed.dtype}"
        )
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"native kernels: a bias of {n} values expected, got {list(bias.shape)}")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A dense [N, K] weight in the layout its best kernel here streams: bfloat16 pairs where the CPU has bf16
    dot products, else blocks of 16 outputs (`linear` tells them apart by their rank)."""
    if weight.dtype == torch.bfloat16 and has_bf16_dot() and not has_amx():
        return pack_bf16dot_weight(weight)
    return pack_gemv_weight(weight)


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ a `pack`ed weight of `n` outputs (+ bias) -> [M, n] in x's dtype. For the engine's linears,
    whose shapes hold by construction: no checks on the way (the step calls it ~120 times)."""
    if packed.dim() == 4:
        return torch.ops.tessera.gemv_bf16dot(x, packed, n, bias)
    return torch.ops.tessera.gemv(x, packed, n, bias, cpu_isa())


def gemv(x: torch.Tensor, packed: torch.Tensor, n: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ the packed weight of `n` outputs (+ bias) -> [M, n] in x's dtype; products and sums in float32
    whatever the weight's dtype (float32, bfloat16 or float16). Fastest for the few rows of decode steps."""
    k = x.shape[-1] if x.dim() == 2 else -1
    _check(x, packed, n, bias, (-(-n // BLOCK), k, BLOCK), (torch.float32, torch.bfloat16, torch.float16))
    return torch.ops.tessera.gemv(x, packed, n, bias, _isa(cpu_isa()))


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [ceil(N / 16), 16, ...], rows past N zero."""
    n = t.shape[0]
    padded = t.new_zeros((-(-n // BLOCK) * BLOCK, *t.shape[1:]))
    padded[:n] = t
    return padded.view(-1, BLOCK, *t.shape[1:])


def pack_int8(
    q: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values q [N, K] (K even) with a scale per group of inputs, scale [N, K / G] (w = q * scale, or with a
    `zero` [N, K / G] w = q * scale + zero), or one per output, scale [N] -> the layout `gemv_int8` streams: int8
    [ceil(N / 16), K / 2, 16, 2] (at each k pair the 16 outputs' two values side by side) and scales
    [ceil(N / 16), K / G, 16] (with zeros [ceil(N / 16), K / G, 2, 16]; rows past N zero). A scale per output
    is repeated over groups of the largest even divisor of K up to 512 (the kernel sums a group in int32)."""
    n, k = q.shape
    if scale.dim() == 1:
        group = max(g for g in range(2, min(k, 512) + 1, 2) if k % g == 0)
        scale = scale[:, None].expand(n, k // group)
    pairs = _blocks(q).view(-1, BLOCK, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    if zero is None:
        return pairs, _blocks(scale).transpose(1, 2).contiguous()
    return pairs, _blocks(torch.stack((scale, zero), dim=1)).permute(0, 3, 2, 1).contiguous()


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit values q (0..15) [N, K] (K a multiple of 4) with a scale and a zero per group, [N, K / G] each
    (w = (q - p) * scale + zero, p the kernel's zero point) -> the layout `gemv_int4` streams:
    uint8 [ceil(N / 16), K / 4, 16, 2], of each 4 k byte (i, 0) holding output i's q at k 4t (low nibble) and
    4t + 2 (high), byte (i, 1) those at 4t + 1 and 4t + 3; and scales [ceil(N / 16), K / G, 2, 16] (rows past N
    zero)."""
    n, k = q.shape
    quads = q.to(torch.uint8).view(n, k // 4, 2, 2)
    nibbles = quads[:, :, 0] | (quads[:, :, 1] << 4)  # [N, K / 4, 2]
    pairs = _blocks(nibbles).permute(0, 2, 1, 3).contiguous()
    return pairs, _blocks(torch.stack((scale, zero), dim=1)).permute(0, 3, 2, 1).contiguous()


def quant_isa() -> Optional[int]:
    """The ISA of the int8 / int4 kernels: AVX-512 where the CPU also has VNNI (int16 dot products), else AVX2."""
    isa = cpu_isa()
    return ISA_AVX512 if isa == ISA_AVX512 and "avx512_vnni" in _cpu_flags() else isa


def linear_int8(x, packed, scales, n: int, bias=None) -> torch.Tensor:
    """x [M, K] @ a `pack_int8` weight of `n` outputs (+ bias) -> [M, n] in x's dtype; unchecked (engine linears)."""
    return torch.ops.tessera.gemv_int8(x, packed, scales, n, bias, quant_isa())


def linear_int4(x, packed, scales, n: int, bias=None, zero_point: int = 8) -> torch.Tensor:
    """x [M, K] @ a `pack_int4` weight of `n` outputs (+ bias) -> [M, n] in x's dtype; unchecked (engine linears)."""
    return torch.ops.tessera.gemv_int4(x, packed, scales, n, bias, quant_isa(), zero_point)


def gemv_int8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int, bias=None) -> torch.Tensor:
    """x [M, K] @ the int8 weight (`pack_int8`) of `n` outputs (+ bias) -> [M, n] in x's dtype, by int16 dot
    products: x quantized per row and group to int16 (an error of at most max |x| of the group / 65534 an
    element), sums exact in int32 per group, then float32. Scales [N / 16, K / G, 16] (w = q * s) or with
    zeros, [N / 16, K / G, 2, 16] (w = q * s + z)."""
    k = x.shape[-1] if x.dim() == 2 and x.shape[-1] % 2 == 0 else -2
    _check(x, packed, n, bias, (-(-n // BLOCK), k // 2, BLOCK, 2), (torch.int8,))
    tail = (2, BLOCK) if scales.dim() == 4 else (BLOCK,)
    _check_scales(scales, packed.shape[0], k, tail, multiple=2, largest=512)
    return torch.ops.tessera.gemv_int8(x, packed, scales, n, bias, _isa(quant_isa()))


def gemv_int4(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int, bias=None, zero_point: int = 8
) -> torch.Tensor:
    """x [M, K] @ the int4 weight (`pack_int4`, w = (q - zero_point) * s + z) of `n` outputs (+ bias) -> [M, n]
    in x's dtype, by int16 dot products as `gemv_int8` (each group: s * sum(q * xq) * sx + (z - zero_point * s)
    * sum(xq) * sx)."""
    k = x.shape[-1] if x.dim() == 2 and x.shape[-1] % 4 == 0 else -4
    _check(x, packed, n, bias, (-(-n // BLOCK), k // 4, BLOCK, 2), (torch.uint8,))
    _check_scales(scales, packed.shape[0], k, (2, BLOCK), multiple=4, largest=4096)
    if not 0 <= zero_point <= 15:
        raise ValueError(f"native kernels: an int4 zero point in 0..15 expected, got {zero_point}")
    return torch.ops.tessera.gemv_int4(x, packed, scales, n, bias, _isa(quant_isa()), zero_point)


def _check_scales(scales: torch.Tensor, blocks: int, k: int, tail: tuple[int, ...], multiple: int, largest: int):
    groups = scales.shape[1] if scales.dim() == 2 + len(tail) else 0
    size = k // groups if groups and k > 0 and k % groups == 0 else 0
    if (
        tuple(scales.shape) != (blocks, groups, *tail)
        or not size
        or size % multiple
        or size > largest
        or scales.dtype not in (torch.float32, torch.bfloat16, torch.float16)
    ):
        raise ValueError(
            f"native kernels: scales [{blocks}, K / G, {', '.join(map(str, tail))}] of float32, bfloat16 or float16 "
            f"with groups G of a multiple of {multiple} inputs up to {largest} dividing K = {k} expected, got "
            f"{list(scales.shape)} of {scales.dtype}"
        )


def _isa(isa: Optional[int]) -> int:
    if isa is None or not available():
        raise RuntimeError(_status()[1])
    return isa


if __name__ == "__main__":  # `make setup`: build now, say what runs
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"Tessera native CPU kernels: {describe()} ({build_directory()})")
