"""Weight-only int8 quantization of the language model's linears, done at load time.

Each `Linear` weight [out, in] becomes int8 values with one scale per output channel (symmetric:
scale = max|row| / 127, q = round(w / scale), so |w - q * scale| <= scale / 2). Activations stay in
the model dtype; `cpu_kernels.int8_linear` multiplies them by the int8 weight with torch's
`aten._weight_int8pack_mm` (decode-sized inputs) or by the de-quantized weight (prefill, or a
CPU/dtype where the op fails its probe, or under TESSERA_CPU_KERNELS=fallback).

A tied lm_head is quantized too: it gets its own int8 copy (a quarter of the float32 embedding's bytes)
while the embedding keeps its float weight for the row lookup; at batch-1 decode the lm_head is the
largest single matrix read per token.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn

from ..config import check_quantization
from .cpu_kernels import INT8_MM, INT8_MM_ALIGN, int8_kernel
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


def quantize_linears(
    model: nn.Module, method: Optional[str], *, skip: Iterable[str] = (), mode: Optional[str] = None
) -> int:
    """Quantize every `Linear` of `model` (but those under the submodules named in `skip`) by `method`
    ("int8"; None does nothing), dropping each float weight unless another module shares it (a tied
    embedding). `mode` ("auto"/"fallback") overrides $TESSERA_CPU_KERNELS for the kernel choice.
    Returns how many layers were quantized; the model is for inference afterwards."""
    method = check_quantization(method)
    if method is None:
        return 0
    skip = tuple(skip)
    users: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        users[id(param)] = users.get(id(param), 0) + 1
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.qweight is not None:
            continue
        if any(name == prefix or name.startswith(prefix + ".") for prefix in skip):
            continue
        weight = module.weight
        if weight is None or not weight.is_floating_point() or weight.dim() != 2 or module.packed_weight is not None:
            continue
        module.qweight, module.qscale = quantize_int8(weight)
        module.int8_mm = (
            weight.device.type == "cpu"
            and weight.shape[1] % INT8_MM_ALIGN == 0
            and int8_kernel(weight.dtype, mode) == INT8_MM
        )
        if users[id(weight)] == 1:
            module.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False)
        count += 1
    kernels = sorted({"int8 mm" if m.int8_mm else "de-quantize" for m in model.modules() if _is_quantized(m)})
    logger.info("Quantized %d linear layers to int8 weights (kernel: %s)", count, ", ".join(kernels) or "none")
    dtypes = {m.qscale.dtype for m in model.modules() if _is_quantized(m) and m.qweight.device.type == "cpu"}
    if dtypes - {torch.bfloat16} and platform.machine().lower() in ("x86_64", "amd64"):
        logger.warning(
            "int8 weights with %s activations: torch's int8 CPU kernel is vectorized for bfloat16 only on x86, "
            "so these decode slower than unquantized; dtype='bfloat16' runs int8 fast",
            "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes - {torch.bfloat16})),
        )
    return count


def _is_quantized(module: nn.Module) -> bool:
    return isinstance(module, Linear) and module.qweight is not None
