"""Weight-only quantization of the language model's linears, done at load time: int8 or group-wise int4.

int8: each group of `INT8_GROUP_SIZE` (32) consecutive inputs of an output channel gets its own scale (symmetric:
scale = max|group| / 127, q = round(w / scale), so |w - q * scale| <= scale / 2); a layer whose in_features is
not a multiple of 32 gets one scale per output channel. Groups keep a channel's outlier inputs from coarsening
the rest of its row: on real SmolLM2 the mean logit error fell from 0.31 to 0.21 (`benchmarks/quantization_error`).

int4: each group of `group_size` (32) consecutive inputs of an output channel gets its own scale and zero
(asymmetric: w ~ (q - 8) * scale + zero, q in 0..15, torch's int4 kernels' formula), so |w - dq| <= scale / 2
with scale ~ (max - min) / 15 of the group. A layer whose in_features is not a multiple of the group size
stays in its float dtype (counted in the log line): every linear of the supported models has in_features a
multiple of 32. Scales and zeros are in the weight's dtype.

Kernels: where the native kernels are built (`native_kernels`), the values are re-packed for their int16 dot
products (`gemv_int8`, `gemv_int4`: decode reads half a byte or a byte a weight); else int8 de-quantizes for
F.linear, and int4 runs torch's `aten._weight_int4pack_mm_for_cpu` where it works (`int4_kernels`).
`Linear.quant_kernel` says which; `dequantized_weight` gives any layer's weight back.

A tied lm_head is quantized too: it gets its own quantized copy while the embedding keeps its float weight for
the row lookup; at batch-1 decode the lm_head is the largest single matrix read per token.
"""

from __future__ import annotations

import functools
import logging
import math
import platform
from collections.abc import Iterable, Mapping
from typing import Optional

import torch
from torch import nn

from ..config import check_quantization
from . import native_kernels
from .cpu_kernels import DEQUANT, NATIVE, int8_kernel, kernel_mode
from .gguf_blocks import QuantizedBlocks
from .int4_kernels import INT4_MM, INT4_MM_N_ALIGN, int4_kernel, int4_layout, int4_mm_takes, pack_int4, unpack_int4
from .linear import Linear

logger = logging.getLogger(__name__)


def quantize_int8(weight: torch.Tensor, group_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (int8 [out, in], scale in the weight's dtype), symmetric: one scale per output
    channel ([out]), or per group of `group_size` consecutive inputs of each ([out, in / group_size]). The scale
    is rounded to its dtype before the values are, so the bound |w - q * scale| <= scale / 2 holds for the stored
    scale (rounding it moves it by far less than 127.5 / 127)."""
    rows, cols = weight.shape
    if group_size is not None and (group_size <= 0 or cols % group_size):
        raise ValueError(f"in_features {cols} is not a multiple of the int8 group size {group_size}")
    w = weight.detach().float().view(rows, -1, group_size or cols)
    amax = w.abs().amax(dim=-1)
    tiny = torch.finfo(weight.dtype).tiny if weight.dtype.is_floating_point else torch.finfo(torch.float32).tiny
    scale = (amax / 127).clamp(min=tiny).to(weight.dtype)
    q = torch.round(w / scale.float()[..., None]).clamp(-127, 127).to(torch.int8).view(rows, cols)
    return q, scale if group_size is not None else scale[:, 0]


INT8_GROUP_SIZE = 32
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


def _quantize_int8_layer(module: Linear, weight: torch.Tensor, mode: str) -> bool:
    group = INT8_GROUP_SIZE if weight.shape[1] % INT8_GROUP_SIZE == 0 else weight.shape[1]
    q, scale = quantize_int8(weight, group)
    native = weight.device.type == "cpu" and weight.shape[1] % 2 == 0 and int8_kernel(mode) == NATIVE
    module.quant_kernel = NATIVE if native else DEQUANT
    module.qweight, module.qscale = native_kernels.pack_int8(q, scale) if native else (q, scale)
    return True


def _quantize_int4_layer(module: Linear, weight: torch.Tensor, mode: str, group_size: int) -> bool:
    """Quantizes `module` (setting its `quant_kernel`); False where it stays float."""
    if weight.shape[1] % group_size:
        return False
    q, scales_and_zeros = quantize_int4(weight, group_size)
    kernel = int4_kernel(weight.dtype, mode) if weight.device.type == "cpu" else DEQUANT
    if kernel == NATIVE and group_size % 4 == 0 and group_size <= 4096:
        module.quant_kernel = NATIVE
        module.qweight, module.qscale = native_kernels.pack_int4(q, *scales_and_zeros.permute(2, 1, 0))
        return True
    use_mm = kernel == INT4_MM and int4_mm_takes(weight.shape[1], group_size)
    module.quant_kernel = INT4_MM if use_mm else DEQUANT
    pad = -weight.shape[0] % INT4_MM_N_ALIGN if use_mm else 0
    if pad:  # rows the op can pack: q = 8 with scale and zero 0 de-quantizes to 0
        q = torch.cat((q, q.new_full((pad, q.shape[1]), 8)))
        scales_and_zeros = torch.cat(
            (scales_and_zeros, scales_and_zeros.new_zeros(scales_and_zeros.shape[0], pad, 2)), 1
        )
    module.qweight, module.qscale = pack_int4(q, op_layout=use_mm), scales_and_zeros
    return True


def keep_gguf_blocks(module: Linear, blocks: QuantizedBlocks, mode: str) -> Optional[str]:
    """Packs a GGUF file's blocks (their values exactly) for the native kernels: "int4" (zero point 0) where every
    q is in 0..15, else "int8" (with zeros where the type has them); None where the native kernels do not run
    here or the shape does not fit them (the layer is then quantized from its de-quantized weight)."""
    if module.weight.device.type != "cpu" or int8_kernel(mode) != NATIVE:
        return None
    rows, cols = blocks.q.shape
    if (rows, cols) != (module.out_features, module.in_features) or blocks.group % 2 or blocks.group > 512:
        return None
    if blocks.four_bit and cols % 4 == 0 and blocks.group % 4 == 0:
        module.qweight, module.qscale = native_kernels.pack_int4(blocks.q.to(torch.uint8), blocks.scale, blocks.zero)
        module.qzero_point, module.quantization = 0, "int4"
    else:
        module.qweight, module.qscale = native_kernels.pack_int8(blocks.q, blocks.scale, blocks.zero)
        module.quantization = "int8"
    module.quant_kernel = NATIVE
    return module.quantization


def quantized_values(module: Linear) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """A quantized layer's values whatever its kernel's layout: q [out, in] (int8, or uint8 0..15 for int4), the
    scales [out, groups] and the zeros [out, groups] (int4; int8 from a GGUF file's blocks), else None; without any
    padding rows. `dequantized_weight` says how they combine."""
    n = module.out_features
    if module.quantization == "int8":
        if module.quant_kernel == NATIVE:
            pairs, scales = module.qweight, module.qscale  # [blocks, K / 2, 16, 2], [blocks, groups, (2,) 16]
            q = pairs.permute(0, 2, 1, 3).reshape(-1, module.in_features)[:n]
            if scales.dim() == 3:
                return q, scales.transpose(1, 2).reshape(-1, scales.shape[1])[:n], None
            scale_zero = scales.permute(0, 3, 1, 2).reshape(-1, scales.shape[1], 2)[:n]
            return q, scale_zero[..., 0], scale_zero[..., 1]
        return module.qweight, module.qscale, None
    if module.quant_kernel == NATIVE:
        nibbles, scales = module.qweight, module.qscale  # [blocks, K / 4, 16, 2], [blocks, groups, 2, 16]
        bytes_ = nibbles.permute(0, 2, 1, 3).reshape(-1, module.in_features // 4, 2)[:n]
        q = torch.stack((bytes_ & 15, bytes_ >> 4), dim=2).view(n, module.in_features)  # k 4t, 4t + 1, 4t + 2, 4t + 3
        scale_zero = scales.permute(0, 3, 1, 2).reshape(-1, scales.shape[1], 2)[:n]
        return q, scale_zero[..., 0], scale_zero[..., 1]
    q = unpack_int4(module.qweight, int4_layout() if module.quant_kernel == INT4_MM else None)[:n]
    return q, module.qscale[..., 0].t()[:n], module.qscale[..., 1].t()[:n]


def dequantized_weight(module: Linear) -> torch.Tensor:
    """A quantized layer's weight [out, in] in float64, exactly: int8 q * scale (+ zero), int4 (q - p) * scale +
    zero (p = `Linear.qzero_point`)."""
    q, scale, zero = quantized_values(module)
    rows, cols = q.shape
    group = cols // scale.shape[1]
    scale = scale.double().repeat_interleave(group, dim=1)
    offset = module.qzero_point if module.quantization == "int4" else 0
    weight = (q.double() - offset) * scale
    return weight if zero is None else weight + zero.double().repeat_interleave(group, dim=1)


def quantize_linears(
    model: nn.Module,
    method: Optional[str],
    *,
    skip: Iterable[str] = (),
    mode: Optional[str] = None,
    group_size: int = INT4_GROUP_SIZE,
    blocks: Mapping[str, QuantizedBlocks] = {},
) -> int:
    """Quantize every `Linear` of `model` (but those under the submodules named in `skip`) by `method`
    ("int8", "int4" in groups of `group_size` inputs; None does nothing), dropping each float weight unless
    another module shares it (a tied embedding). A layer named in `blocks` (a GGUF file's, `keep_gguf_blocks`)
    keeps those values where it can. `mode` ("auto"/"fallback") overrides $TESSERA_CPU_KERNELS for the kernel
    choice. Returns how many layers were quantized; the model is for inference afterwards."""
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
    count, kept_float, kernels, kept_blocks, forms = 0, 0, set(), 0, {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.qweight is not None:
            continue
        if any(name == prefix or name.startswith(prefix + ".") for prefix in skip):
            continue
        weight = module.weight
        packed = module.packed_weight is not None or module.native_weight is not None
        if weight is None or not weight.is_floating_point() or weight.dim() != 2 or packed:
            continue
        if name in blocks and keep_gguf_blocks(module, blocks[name], mode):
            kept_blocks += 1
        elif quantize(module, weight, mode):
            module.quantization = method
        else:
            kept_float += 1
            continue
        kernels.add(module.quant_kernel)
        forms[module.quantization] = forms.get(module.quantization, 0) + 1
        if users[id(weight)] == 1:
            module.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False)
        count += 1
    logger.info(
        "Quantized %d linear layers to %s weights (kernel: %s)%s%s",
        count,
        " / ".join(f"{form} ({n})" for form, n in sorted(forms.items())) if len(forms) > 1 else method,
        ", ".join(sorted(kernels)) or "none",
        f"; {kept_blocks} of them keep the GGUF file's blocks" if blocks else "",
        f"; {kept_float} kept their dtype (in_features not a multiple of {group_size})" if kept_float else "",
    )
    dtypes = {
        m.qscale.dtype
        for m in model.modules()
        if _is_quantized(m) and m.qweight.device.type == "cpu" and m.quant_kernel == INT4_MM
    }
    if dtypes - {torch.bfloat16} and platform.machine().lower() in ("x86_64", "amd64"):
        logger.warning(
            "int4 weights with %s activations: torch's int4 CPU kernel is vectorized for bfloat16 only on x86 (the "
            "native kernels are not built here: %s), so these decode slower than unquantized; dtype='bfloat16' runs "
            "int4 fast",
            "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes - {torch.bfloat16})),
            native_kernels.describe(),
        )
    return count


def _is_quantized(module: nn.Module) -> bool:
    return isinstance(module, Linear) and module.qweight is not None
