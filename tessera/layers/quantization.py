"""Weight-only quantization of the language model's linears, done at load time: int8 or group-wise int4.

int8: each `Linear` weight [out, in] becomes int8 values with one scale per output channel (symmetric:
scale = max|row| / 127, q = round(w / scale), so |w - q * scale| <= scale / 2). Activations stay in
the model dtype; `cpu_kernels.int8_linear` multiplies them by the int8 weight with torch's
`aten._weight_int8pack_mm` (decode-sized inputs) or by the de-quantized weight (prefill, or a
CPU/dtype where the op fails its probe, or under TESSERA_CPU_KERNELS=fallback).

int4: each group of `group_size` (32) consecutive inputs of an output channel gets its own scale and zero
(asymmetric: w ~ (q - 8) * scale + zero, q in 0..15, torch's int4 kernels' formula), so |w - dq| <= scale / 2
with scale ~ (max - min) / 15 of the group. `cpu_kernels.int4_linear` runs
`aten._weight_int4pack_mm_for_cpu` for up to 256 rows (bfloat16; 1 for float32) where its probe passes,
with out_features padded to a multiple of 16 for it, else de-quantizes to float32 (bit for bit the weight
the op computes) and runs F.linear. A layer whose in_features is not a multiple of the group size stays in
its float dtype (counted in the log line): every linear of the supported models has in_features a multiple
of 32. Bytes kept: half a byte per weight plus a scale and a zero per group (5/16 of bfloat16 for groups of
32, 3/16 of float32).

A tied lm_head is quantized too: it gets its own quantized copy (int8: a quarter of the float32 embedding's
bytes, int4: 3/16) while the embedding keeps its float weight for the row lookup; at batch-1 decode the lm_head is the
largest single matrix read per token.
"""

from __future__ import annotations

import functools
import logging
import math
import platform
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn

from ..config import check_quantization
from .cpu_kernels import INT8_MM, INT8_MM_ALIGN, int8_kernel, kernel_mode
from .int4_kernels import INT4_MM, INT4_MM_N_ALIGN, int4_kernel, int4_mm_takes, pack_int4
from .linear import Linear

logger = logging.getLogger(__name__)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (int8 [out, in], scale [out] in the weight's dtype), per output channel,
    symmetric. The scale is rounded to its dtype before the values are, so the bound |w - q * scale| <=
    scale / 2 holds for the stored scale (rounding it moves it by far less than 127.5 / 127)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    tiny = torch.finfo(weight.dtype).tiny if weight.dtype.is_floating_point else torch.finfo(torch.float32).tiny
    scale = (amax / 127).clamp(min=tiny).to(weight.dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


INT4_GROUP_SIZE = 32


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (uint8 [out, in] values q in 0..15, scales_and_zeros [in / group_size, out, 2] in
    the weight's dtype; torch's int4 kernels' layout): per group of `group_size` inputs of an output channel,
    w ~ (q - 8) * scale + zero with |w - dq| <= scale / 2 for the stored scale and zero.

    scale ~ (max - min) / 15 is rounded up to the dtype, so 15 steps still span the group, and zero ~ the middle
    of the group + scale / 2, so [zero - 8.5 scale, zero + 7.5 scale] covers [min, max] with half a step to
    spare each side: the zero's rounding to the dtype (<= eps / 2 of it) may use up to a quarter step because
    the scale is at least 4 eps |middle| (only groups far from 0 for their spread get a coarser step)."""
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"in_features {cols} is not a multiple of the int4 group size {group_size}")
    dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
    info = torch.finfo(dtype)
    w = weight.detach().float().view(rows, cols // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    middle = (low + high) / 2
    scale = torch.maximum((high - low) / 15, middle.abs() * (4 * info.eps)).clamp(min=info.tiny)
    stored = scale.to(dtype)
    stored = torch.where(stored.float() < scale, stored.nextafter(torch.full_like(stored, math.inf)), stored)
    zero = (middle + stored.float() / 2).to(dtype)
    steps = (w - zero.float()[..., None]).div_(stored.float()[..., None]).round_()
    q = steps.add_(8).clamp_(0, 15).to(torch.uint8).view(rows, cols)
    return q, torch.stack((stored, zero), dim=-1).transpose(0, 1).contiguous()


def _quantize_int8_layer(module: Linear, weight: torch.Tensor, mode: str) -> Optional[str]:
    module.qweight, module.qscale = quantize_int8(weight)
    module.quant_mm = (
        weight.device.type == "cpu"
        and weight.shape[1] % INT8_MM_ALIGN == 0
        and int8_kernel(weight.dtype, mode) == INT8_MM
    )
    return "int8 mm" if module.quant_mm else "de-quantize"


def _quantize_int4_layer(module: Linear, weight: torch.Tensor, mode: str, group_size: int) -> Optional[str]:
    if weight.shape[1] % group_size:
        return None  # stays float
    q, scales_and_zeros = quantize_int4(weight, group_size)
    module.quant_mm = (
        weight.device.type == "cpu"
        and int4_mm_takes(weight.shape[1], group_size)
        and int4_kernel(weight.dtype, mode) == INT4_MM
    )
    pad = -weight.shape[0] % INT4_MM_N_ALIGN if module.quant_mm else 0
    if pad:  # rows the op can pack: q = 8 with scale and zero 0 de-quantizes to 0
        q = torch.cat((q, q.new_full((pad, q.shape[1]), 8)))
        scales_and_zeros = torch.cat(
            (scales_and_zeros, scales_and_zeros.new_zeros(scales_and_zeros.shape[0], pad, 2)), 1
        )
    module.qweight, module.qscale = pack_int4(q, op_layout=module.quant_mm), scales_and_zeros
    return "int4 mm" if module.quant_mm else "de-quantize"


def quantize_linears(
    model: nn.Module,
    method: Optional[str],
    *,
    skip: Iterable[str] = (),
    mode: Optional[str] = None,
    group_size: int = INT4_GROUP_SIZE,
) -> int:
    """Quantize every `Linear` of `model` (but those under the submodules named in `skip`) by `method`
    ("int8", "int4" in groups of `group_size` inputs; None does nothing), dropping each float weight unless
    another module shares it (a tied embedding). `mode` ("auto"/"fallback") overrides $TESSERA_CPU_KERNELS for
    the kernel choice. Returns how many layers were quantized; the model is for inference afterwards."""
    method = check_quantization(method)
    if method is None:
        return 0
    mode = kernel_mode(mode)
    quantize = {
        "int8": _quantize_int8_layer,
        "int4": functools.partial(_quantize_int4_layer, group_size=group_size),
    }[method]
    skip = tuple(skip)
    users: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        users[id(param)] = users.get(id(param), 0) + 1
    count, kept_float, kernels = 0, 0, set()
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.qweight is not None:
            continue
        if any(name == prefix or name.startswith(prefix + ".") for prefix in skip):
            continue
        weight = module.weight
        packed = module.packed_weight is not None or module.native_weight is not None
        if weight is None or not weight.is_floating_point() or weight.dim() != 2 or packed:
            continue
        kernel = quantize(module, weight, mode)
        if kernel is None:
            kept_float += 1
            continue
        module.quantization = method
        kernels.add(kernel)
        if users[id(weight)] == 1:
            module.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False)
        count += 1
    logger.info(
        "Quantized %d linear layers to %s weights (kernel: %s)%s",
        count,
        method,
        ", ".join(sorted(kernels)) or "none",
        f"; {kept_float} kept their dtype (in_features not a multiple of {group_size})" if kept_float else "",
    )
    dtypes = {m.qscale.dtype for m in model.modules() if _is_quantized(m) and m.qweight.device.type == "cpu"}
    if dtypes - {torch.bfloat16} and platform.machine().lower() in ("x86_64", "amd64"):
        logger.warning(
            "%s weights with %s activations: torch's %s CPU kernel is vectorized for bfloat16 only on x86, "
            "so these decode slower than unquantized; dtype='bfloat16' runs %s fast",
            method,
            "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes - {torch.bfloat16})),
            method,
            method,
        )
    return count


def _is_quantized(module: nn.Module) -> bool:
    return isinstance(module, Linear) and module.qweight is not None
