"""Linear layers: packed fast paths on CPU, and fused projections.

On CPU the engine re-packs its model's linears once after loading (`pack_linears_for_cpu`; the model
code is unchanged) for the kernel `cpu_kernels.linear_kernel` picks per dtype: Tessera's native
weight-streaming kernel (`native_kernels`: float32, and 16-bit weights oneDNN cannot pack), or oneDNN
with the weight in its blocked layout (bfloat16 where the CPU packs it: ~1.7x the default BLAS call in
decode, ~1.4x in prefill). Other dtypes, or all under `TESSERA_CPU_KERNELS=fallback`, keep their dense
weight and run `F.linear`.

A `Linear` quantized at load (`quantization.quantize_linears`) holds `qweight` and `qscale` buffers
instead of its float weight, in the layout of its `quant_kernel`: the native kernels' blocks of 16 outputs
(`native_kernels.pack_int8` / `pack_int4`), else int8 [out, in] values with scales [out, groups]
(`cpu_kernels.int8_linear`), or int4 values two a byte [out, in / 2] with a scale and zero per group of inputs
and output channel [in / group, out, 2] (`int4_kernels.int4_linear`; for its op, `out` is padded to a multiple
of 16). `quantization.dequantized_weight` reads any of them back.

`MergedLinear` fuses projections that read the same input (q/k/v, gate/up) into one matmul; the
loader fills each shard from the checkpoint tensor named after it.

Tensor parallelism (Megatron's split, as vLLM's layers of the same names): a `ColumnParallelLinear` holds
this rank's rows of the weight (its slice of the outputs: attention heads, MLP channels), a
`RowParallelLinear` its columns (the matching slice of the inputs) and sums the ranks' partial outputs,
so a block costs one all-reduce. Their `shard_weight` cuts a checkpoint tensor to this rank's slice as
the loader reads it. With one rank they are plain `Linear`s and run no collective.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import divide, get_tp_group
from . import native_kernels
from .cpu_kernels import NATIVE, PACKED, int8_linear, kernel_mode, linear_kernel, pack_weight, packed_linear
from .int4_kernels import INT4_MM, int4_linear
from .lora import apply_lora, lora_active


class Linear(nn.Linear):
    packed_weight: Optional[torch.Tensor] = None
    """oneDNN's blocked layout of the weight (`cpu_kernels.pack_weight`), once packed."""
    native_weight: Optional[torch.Tensor] = None
    """The weight as Tessera's native kernel streams it (`native_kernels.pack`)."""
    quantization: Optional[str] = None
    """"int8" or "int4" once quantized (`qweight` / `qscale` hold the weight), else None."""
    quant_kernel: Optional[str] = None
    """A quantized layer's kernel, which also fixes the layout of `qweight` / `qscale`: `cpu_kernels.NATIVE`
    (`native_kernels.pack_int8` / `pack_int4`), `int4_kernels.INT4_MM` (torch's int4 op) or `cpu_kernels.DEQUANT`."""
    qzero_point: int = 8
    """int4's zero point p (w = (q - p) * scale + zero): 8 as Tessera quantizes (torch's formula), 0 for the
    blocks of a GGUF file (w = q * d + m, `gguf_blocks`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("qweight", None)  # int8 [out, in] / uint8 [out, in / 2] (int4) once quantized
        self.register_buffer("qscale", None)  # [out] / [in / group, out, 2] (int4), the weight's dtype

    lora_parts: Optional[dict] = None
    """Loaded LoRA adapters' updates of this layer: adapter id -> its `lora.LoRAPart`s (layers/lora.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._forward(x)
        return apply_lora(x, out, self.lora_parts) if self.lora_parts and lora_active() else out

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            flat = x.reshape(-1, x.shape[-1])
            if self.quant_kernel == NATIVE and self.quantization == "int4":
                out = native_kernels.linear_int4(
                    flat, self.qweight, self.qscale, self.out_features, self.bias, self.qzero_point
                )
            elif self.quant_kernel == NATIVE:
                out = native_kernels.linear_int8(flat, self.qweight, self.qscale, self.out_features, self.bias)
            elif self.quantization == "int4":
                use_mm = self.quant_kernel == INT4_MM
                out = int4_linear(flat, self.qweight, self.qscale, self.bias, use_mm, self.out_features)
            else:
                out = int8_linear(flat, self.qweight, self.qscale, self.bias)
            return out.view(*x.shape[:-1], out.shape[-1])
        if self.native_weight is not None:
            flat = x.reshape(-1, x.shape[-1])
            out = native_kernels.linear(flat, self.native_weight, self.out_features, self.bias)
            return out.view(*x.shape[:-1], out.shape[-1])
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1])
        out = packed_linear(flat, self.packed_weight, self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])


    def native_decode_weight(self) -> Optional[tuple[int, torch.Tensor, Optional[torch.Tensor], int]]:
        """(kind, weight, scales, isa) for the native decode layer (`native_kernels.DecodeKind`), which calls this
        layer's kernel from C++; None where it has no such kernel (torch's int4 op, de-quantizing)."""
        kinds = native_kernels.DecodeKind
        if self.qweight is not None:
            if self.quant_kernel != NATIVE:
                return None
            kind = kinds.INT4 if self.quantization == "int4" else kinds.INT8
            return kind, self.qweight, self.qscale, native_kernels.quant_isa() or 0
        if self.native_weight is not None:
            if self.native_weight.dim() == 4:
                return kinds.BF16_DOT, self.native_weight, None, 0
            return kinds.NATIVE, self.native_weight, None, native_kernels.cpu_isa() or 0
        if self.packed_weight is not None:
            return kinds.ONEDNN, self.packed_weight, None, 0
        return kinds.DENSE, self.weight, None, 0


class MergedLinear(Linear):
    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        """`shards`: checkpoint name of each projection (a sibling of this module) -> output width."""
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)

    def shard_rows(self) -> dict[str, slice]:
        rows, start = {}, 0
        for name, width in self.shards.items():
            rows[name] = slice(start, start + width)
            start += width
        return rows

    def split(self, output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[..., sum(widths)] -> one tensor per shard, in order."""
        return output.split(list(self.shards.values()), dim=-1)


class ColumnParallelLinear(Linear):
    """out_features split over the tensor-parallel ranks: this rank computes its slice of the outputs."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp = get_tp_group()
        super().__init__(in_features, divide(out_features, self.tp.world_size, "out_features"), bias=bias)

    def shard_weight(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint weight [out, in] or bias [out] -> this rank's rows."""
        return tensor.chunk(self.tp.world_size, dim=0)[self.tp.rank]


class MergedColumnParallelLinear(MergedLinear):
    """A `MergedLinear` whose every projection is split over the ranks (q, k and v by heads; gate and up
    by channels): this rank's slice of each, fused."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        self.tp = get_tp_group()
        local = {name: divide(width, self.tp.world_size, f"The width of {name}") for name, width in shards.items()}
        super().__init__(in_features, local, bias=bias)

    shard_weight = ColumnParallelLinear.shard_weight


class RowParallelLinear(Linear):
    """in_features split over the ranks (the outputs of a column-parallel layer before it): each rank's
    partial product is summed over the ranks. The bias is added once, by rank 0's slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        self.tp = get_tp_group()
        super().__init__(divide(in_features, self.tp.world_size, "in_features"), out_features, bias=bias)

    def shard_weight(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint weight [out, in] -> this rank's columns; the bias stays whole on rank 0, zero elsewhere."""
        if param == "bias":
            return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
        return tensor.chunk(self.tp.world_size, dim=1)[self.tp.rank]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


def pack_linears_for_cpu(model: nn.Module, batch_size_hint: int = 16, mode: Optional[str] = None) -> int:
    """Reorder every CPU `Linear` weight for the kernel `cpu_kernels.linear_kernel` picks for its dtype
    (`mode` "auto"/"fallback" overrides $TESSERA_CPU_KERNELS): Tessera's native kernel or oneDNN, and drop
    the dense copy (kept when another module shares it, e.g. tied embeddings). Returns how many layers were packed.
    The model is for inference afterwards: its packed linears no longer hold dense weights."""
    mode = kernel_mode(mode)  # read $TESSERA_CPU_KERNELS once; a typo raises even with no Linear
    users: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        users[id(param)] = users.get(id(param), 0) + 1
    packed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, Linear) or weight is None or weight.device.type != "cpu":
            continue
        if module.qweight is not None:  # int8/int4 weight-only: their own kernels
            continue
        kernel = linear_kernel(weight.dtype, mode)
        if kernel == NATIVE:
            module.native_weight = native_kernels.pack(weight)
        elif kernel == PACKED:
            module.packed_weight = pack_weight(weight, batch_size_hint)
        else:
            continue
        if users[id(weight)] == 1:
            module.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
        packed += 1
    return packed
