"""Weight-only quantization (int8 per group of 32 or per channel, int4 per group): the rounding bounds, every
kernel (native int16 dot products, torch's int4 op, de-quantizing) against the de-quantized reference, which
layers are quantized and how many bytes they keep."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import QUANTIZATION_METHODS, check_quantization
from tessera.layers import native_kernels
from tessera.layers.cpu_kernels import DEQUANT, ENV, NATIVE, PACKED, int8_kernel, linear_kernel
from tessera.layers.int4_kernels import (
    INT4_MM,
    INT4_MM_MAX_ROWS,
    dequantize_int4,
    int4_kernel,
    int4_layout,
    int4_mm,
    int4_mm_works,
)
from tessera.layers.linear import Linear, MergedLinear, pack_linears_for_cpu
from tessera.layers.quantization import (
    INT4_GROUP_SIZE,
    INT8_GROUP_SIZE,
    dequantized_weight,
    quantize_int4,
    quantize_int8,
    quantize_linears,
    quantized_values,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KERNELS = ["native", "torch"]  # "torch": as on a machine without the native kernels (torch's int4 op, de-quantizing)


@pytest.fixture(params=KERNELS)
def kernels(request, monkeypatch):
    """Each test once with the native kernels and once as where they are not built (under "auto", whatever
    $TESSERA_CPU_KERNELS the suite runs with)."""
    monkeypatch.delenv(ENV, raising=False)
    if request.param == "torch":
        monkeypatch.setattr(native_kernels, "available", lambda: False)
    elif not native_kernels.available():
        pytest.fail(native_kernels.describe())  # every machine of this project builds them
    return request.param


def _linear(in_features: int, out_features: int, dtype: torch.dtype, bias: bool = True, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias).to(dtype)
    with torch.no_grad():  # rows of very different magnitudes: each needs its own scale
        layer.weight.mul_(torch.logspace(-3, 1, out_features)[:, None].to(dtype))
    return layer


@pytest.mark.parametrize("group", [None, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_error_is_at_most_half_a_scale(dtype, group):
    weight = torch.randn(48, 96) * torch.logspace(-2, 2, 48)[:, None]  # float16 scales stay normal
    weight[3] = 0  # an all-zero row
    weight[5, 7] = 50 * weight[5].abs().max()  # an outlier input: per channel it coarsens the whole row
    weight = weight.to(dtype)
    q, scale = quantize_int8(weight, group)
    groups = 1 if group is None else 96 // group
    assert q.dtype == torch.int8 and q.shape == weight.shape and scale.dtype == dtype
    assert scale.shape == ((48,) if group is None else (48, groups))
    step = scale.double().view(48, -1).repeat_interleave(96 // groups, dim=1)
    error = (weight.double() - q.double() * step).abs()
    assert (error <= step / 2 * (1 + 1e-6)).all()
    assert q.abs().max() <= 127
    grouped = q.view(48, groups, -1).abs().amax(dim=-1)
    assert (grouped[torch.arange(48) != 3] >= 126).all()  # each group uses the whole range
    assert (q[3] == 0).all()
    if group is not None:  # the outlier's group alone takes its coarse step
        assert step[5, 40] * 10 < step[5, 7]


def _x_bound(x: torch.Tensor, layer: Linear) -> torch.Tensor:
    """The native kernels quantize x to int16 per row and group of the weight (an error of at most max |x| of
    the group / 65534 an element): what that moves each output by, at most."""
    weight = dequantized_weight(layer).abs()
    groups = quantized_values(layer)[1].shape[1]
    flat = x.reshape(-1, x.shape[-1]).double()
    amax = flat.view(flat.shape[0], groups, -1).abs().amax(dim=-1) / 65534  # [rows, groups]
    per_group = weight.view(weight.shape[0], groups, -1).sum(dim=-1)  # [out, groups]
    return (amax @ per_group.T).view(*x.shape[:-1], -1)


def _int8_bound(x: torch.Tensor, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
    """Rounding to `dtype` (the output, and the de-quantized weight when de-quantizing), float32 sums (each of
    in_features + 1 additions by at most 2^-24 of what it sums), and the native kernels' int16 x."""
    eps = {torch.float32: 0, torch.bfloat16: 2**-8, torch.float16: 2**-10}[dtype]
    bias = None if layer.bias is None else layer.bias.double().abs()
    magnitude = F.linear(x.double().abs(), dequantized_weight(layer).abs(), bias)
    bound = (eps + (layer.in_features + 2) * 2**-24) * magnitude + 1e-30
    return bound + (_x_bound(x, layer) if layer.quant_kernel == NATIVE else 0)


@pytest.mark.parametrize("mode", ["auto", "fallback"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 40])
@pytest.mark.parametrize("in_features", [64, 40, 33])  # 40: one scale per channel; 33: odd, never native
def test_int8_linear_equals_the_dequantized_matmul(kernels, mode, dtype, rows, in_features):
    layer = _linear(in_features, 20, dtype)
    assert quantize_linears(layer, "int8", mode=mode) == 1
    assert layer.weight.numel() == 0 and layer.quantization == "int8"
    native = kernels == "native" and mode == "auto" and in_features % 2 == 0
    assert layer.quant_kernel == (NATIVE if native else DEQUANT)
    q, scale, zero = quantized_values(layer)
    assert q.dtype == torch.int8 and q.shape == (20, in_features) and zero is None
    assert scale.shape == (20, in_features // INT8_GROUP_SIZE if in_features % INT8_GROUP_SIZE == 0 else 1)
    x = torch.randn(2, rows, in_features).to(dtype)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (2, rows, 20) and out.dtype == dtype
    ref = F.linear(x.double(), dequantized_weight(layer), layer.bias.double())
    assert ((out.double() - ref).abs() <= _int8_bound(x, layer, dtype)).all()


def test_the_native_kernels_take_unaligned_and_strided_inputs():
    layer = _linear(64, 24, torch.float32, bias=False)
    quantize_linears(layer, "int8", mode="auto")
    assert layer.quant_kernel == NATIVE
    base = torch.randn(3 * 130 + 1)
    x = base[1:].view(3, 130)[:, 3:67]  # starts 1 element past an aligned allocation, rows 130 apart
    with torch.no_grad():
        out = layer(x)
    ref = F.linear(x.double(), dequantized_weight(layer))
    assert ((out.double() - ref).abs() <= _int8_bound(x, layer, torch.float32) + 1e-30).all()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_kernel_choice_follows_the_build_the_probe_and_the_switch(monkeypatch, method):
    monkeypatch.delenv(ENV, raising=False)
    choose = (lambda d: int8_kernel()) if method == "int8" else int4_kernel
    assert choose(torch.bfloat16) == NATIVE  # built on every machine of this project
    monkeypatch.setattr(native_kernels, "available", lambda: False)
    if method == "int8":
        assert int8_kernel() == DEQUANT
    else:
        assert int4_kernel(torch.bfloat16) == (INT4_MM if int4_mm_works(torch.bfloat16) else DEQUANT)
        assert int4_kernel(torch.float16, "auto") == DEQUANT  # torch's op never beats de-quantizing it
    monkeypatch.undo()
    monkeypatch.setenv(ENV, "fallback")
    assert choose(torch.bfloat16) == DEQUANT


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.qkv = MergedLinear(32, {"q": 32, "k": 16, "v": 16})
        self.vision = nn.Sequential(Linear(32, 32))
        self.lm_head = Linear(32, 50, bias=False)
        self.lm_head.weight = self.embed.weight  # tied


def test_skipped_parts_stay_float_and_a_tied_lm_head_keeps_the_embedding(kernels):
    model = _TinyLM()
    embedding = model.embed.weight.detach().clone()
    assert quantize_linears(model, "int8", skip=["vision"]) == 2  # qkv and lm_head
    assert model.vision[0].qweight is None and model.vision[0].weight.shape == (32, 32)
    assert quantized_values(model.qkv)[0].shape == (64, 32) and model.qkv.weight.numel() == 0
    assert quantized_values(model.lm_head)[0].shape == (50, 32)
    x = torch.randn(3, 32)
    with torch.no_grad():
        out = model.lm_head(x)
    ref = F.linear(x.double(), dequantized_weight(model.lm_head))
    assert out.shape == (3, 50) and ((out.double() - ref).abs() <= 1e-3 * ref.abs().max()).all()
    assert model.lm_head.weight is model.embed.weight and torch.equal(model.embed.weight, embedding)
    packs = linear_kernel(torch.float32, "auto") in (PACKED, NATIVE)
    assert pack_linears_for_cpu(model, mode="auto") == packs  # only the float vision linear; quantized ones stay int8
    assert model.qkv.qweight is not None and model.qkv.packed_weight is None and model.qkv.native_weight is None
    assert quantize_linears(model, None) == 0
    assert quantize_linears(model, "int8") == (0 if packs else 1)  # quantized ones once; a packed one never


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weights_take_a_byte_and_a_scale_per_group_of_32(kernels, dtype):
    model = nn.Sequential(_linear(256, 128, dtype), _linear(128, 256, dtype))
    numel = sum(m.weight.numel() for m in model)
    quantize_linears(model, "int8")
    kept = sum(
        b.numel() * b.element_size() for name, b in model.named_buffers() if name.endswith(("qweight", "qscale"))
    )
    kept += sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name.endswith("weight"))
    size = torch.finfo(dtype).bits // 8
    assert kept == numel + numel // INT8_GROUP_SIZE * size  # float32: 9/32 of its bytes, bfloat16: 17/32


@pytest.mark.parametrize("name", ["int3", "fp8", "awq", 8])
def test_unknown_methods_are_refused_with_the_supported_ones(name):
    with pytest.raises(ValueError, match="supported: int8, int4"):
        check_quantization(name)


def test_method_names_are_case_insensitive():
    assert QUANTIZATION_METHODS == ("int8", "int4")
    assert check_quantization("INT8") == "int8" and check_quantization("Int4") == "int4"
    assert check_quantization(None) is None


# --- int4 ------------------------------------------------------------------------------------------------------


def _int4_dequantized(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """Exact (float64) (q - 8) * scale + zero of `quantize_int4`'s output, [out, in]."""
    group = q.shape[1] // scales_and_zeros.shape[0]
    scale, zero = (scales_and_zeros[..., i].double().t().repeat_interleave(group, dim=1) for i in (0, 1))
    return (q.double() - 8) * scale + zero


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_rounding_error_is_at_most_half_a_scale_per_group(dtype):
    torch.manual_seed(0)
    weight = torch.randn(48, 128) * torch.logspace(-2, 2, 48)[:, None]  # float16 scales stay normal
    weight[3] = 0  # all-zero groups
    weight[4] += 1000 * weight[4].abs().max()  # far from 0 for their spread: the zero's rounding matters
    weight[5, 32:64] = 0.75  # a constant group
    weight = weight.to(dtype)
    q, scales_and_zeros = quantize_int4(weight)
    assert q.dtype == torch.uint8 and q.shape == weight.shape and q.max() <= 15
    assert scales_and_zeros.shape == (128 // INT4_GROUP_SIZE, 48, 2) and scales_and_zeros.dtype == dtype
    scale = scales_and_zeros[..., 0].double().t().repeat_interleave(INT4_GROUP_SIZE, dim=1)
    error = (weight.double() - _int4_dequantized(q, scales_and_zeros)).abs()
    assert (error <= scale / 2 * (1 + 1e-6)).all()
    # Ordinary groups: the scale is (max - min) / 15 rounded up to the dtype, and q spans 0..15.
    groups = weight.double().view(48, 4, INT4_GROUP_SIZE)[6:]
    spread = (groups.amax(-1) - groups.amin(-1)) / 15
    stored = scales_and_zeros[:, 6:, 0].double().t()
    assert (stored >= spread * (1 - 1e-6)).all() and (stored <= spread * (1 + 2 * torch.finfo(dtype).eps)).all()
    grouped = q.view(48, 4, INT4_GROUP_SIZE)[6:]
    assert (grouped.amin(-1) == 0).all() and (grouped.amax(-1) == 15).all()


def test_int4_needs_in_features_a_multiple_of_the_group():
    with pytest.raises(ValueError, match="not a multiple of the int4 group size 32"):
        quantize_int4(torch.randn(16, 48))
    layer = _linear(48, 16, torch.float32)
    assert quantize_linears(layer, "int4") == 0  # it stays float
    assert layer.qweight is None and layer.weight.shape == (16, 48)


def _int4_weight(layer: Linear) -> torch.Tensor:
    """A quantized layer's exact de-quantized weight [out, in] (float64), without any padding rows, read back
    from the layout of its kernel; checked against `quantize_int4`'s own values in the tests below."""
    return dequantized_weight(layer)


def _int4_bound(x: torch.Tensor, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
    """What separates `layer(x)` from the exact product with its de-quantized weight: every kernel rounds each
    weight once to float32 (2^-24 relative; native: its zero - 8 scale once per group, the same size), sums in
    float32 (<= in_features * 2^-24 of the sum of |terms|, the classic bound for any order), rounds the sum to
    `dtype` and adds the bias in `dtype` (one half-ulp each); 16-bit inputs of more rows than torch's op takes
    round each weight to `dtype` first when de-quantizing (one more half-ulp); the native kernels' int16 x
    (`_x_bound`)."""
    weight = _int4_weight(layer)
    magnitude = F.linear(x.double().abs(), weight.abs())
    if layer.bias is not None:
        magnitude = magnitude + layer.bias.double().abs()
    unit = torch.finfo(dtype).eps / 2
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    rounded_weight = dtype != torch.float32 and layer.quant_kernel != NATIVE and rows > INT4_MM_MAX_ROWS.get(dtype, 0)
    bound = ((layer.in_features + 2) * 2**-24 + (3 if rounded_weight else 2) * unit) * magnitude + 1e-30
    return bound + (_x_bound(x, layer) if layer.quant_kernel == NATIVE else 0)


def _expected_int4_kernel(kernels: str, mode: str, dtype: torch.dtype) -> str:
    if mode == "fallback":
        return DEQUANT
    if kernels == "native":
        return NATIVE
    return INT4_MM if dtype in INT4_MM_MAX_ROWS and int4_mm_works(dtype) else DEQUANT


@pytest.mark.parametrize("mode", ["auto", "fallback"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 150])  # 300 rows (2 x 150): past INT4_MM_MAX_ROWS, de-quantized by torch
@pytest.mark.parametrize("shape", [(96, 48), (64, 20)])  # 96: 3 groups; 20 outputs: padded to 32 for the kernels
def test_int4_linear_equals_the_dequantized_matmul(kernels, mode, dtype, rows, shape):
    in_features, out_features = shape
    weight = _linear(in_features, out_features, dtype).weight.detach()
    layer = _linear(in_features, out_features, dtype)
    assert quantize_linears(layer, "int4", mode=mode) == 1
    assert layer.weight.numel() == 0 and layer.quantization == "int4"
    assert layer.quant_kernel == _expected_int4_kernel(kernels, mode, dtype)
    q, scales_and_zeros = quantize_int4(weight)  # the values, read back from the kernel's layout
    assert [torch.equal(a, b) for a, b in zip(quantized_values(layer), (q, *scales_and_zeros.permute(2, 1, 0)))] == [
        True
    ] * 3
    padded = -(-out_features // 16) * 16
    if layer.quant_kernel == INT4_MM:
        assert layer.qweight.shape == (padded, in_features // 2)
        assert layer.qscale.shape == (in_features // 32, padded, 2)
        assert (layer.qscale[:, out_features:] == 0).all()  # padding rows de-quantize to 0
    elif layer.quant_kernel == NATIVE:
        assert layer.qweight.shape == (padded // 16, in_features // 4, 16, 2)
        per_row = layer.qscale.permute(0, 3, 1, 2).reshape(padded, -1)  # [blocks, groups, 2, 16] -> [rows, groups x 2]
        assert (per_row[out_features:] == 0).all()  # padding rows de-quantize to 0
    x = torch.randn(2, rows, in_features).to(dtype)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (2, rows, out_features) and out.dtype == dtype
    ref = F.linear(x.double(), _int4_weight(layer), layer.bias.double())
    assert ((out.double() - ref).abs() <= _int4_bound(x, layer, dtype)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_fallback_matches_auto(kernels, monkeypatch, dtype):
    """The same quantized values either way; the outputs differ only in the order of float32 sums (and the
    roundings after them, and the native kernels' int16 x), so each is within `_int4_bound` of the exact
    product and they of each other."""
    monkeypatch.setenv(ENV, "fallback")
    fallback = _linear(128, 64, dtype)
    quantize_linears(fallback, "int4")
    monkeypatch.delenv(ENV)
    auto = _linear(128, 64, dtype)
    quantize_linears(auto, "int4")
    assert fallback.quant_kernel == DEQUANT and auto.quant_kernel == _expected_int4_kernel(kernels, "auto", dtype)
    assert torch.equal(_int4_weight(fallback), _int4_weight(auto))
    for rows in (1, 3, 33, 300):
        x = torch.randn(rows, 128).to(dtype)
        with torch.no_grad():
            a, b = auto(x), fallback(x)
        assert ((a.double() - b.double()).abs() <= 2 * _int4_bound(x, auto, dtype)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # float16 never runs the op (INT4_MM_MAX_ROWS)
def test_int4_fallback_dequantizes_bit_for_bit_as_the_op(monkeypatch, dtype):
    """Fed the identity, torch's op returns the weight it de-quantized (1 * w, sums with zeros: exact) rounded
    to `dtype`: equal to `dequantize_int4` (one fused multiply-add, as the op) rounded to `dtype`, with
    scales and zeros of any bits (float32 ones round (q - 8) * scale + zero: unfused would differ)."""
    if not int4_mm_works(dtype):
        pytest.skip(f"aten._weight_int4pack_mm_for_cpu does not run {dtype} here")
    monkeypatch.setattr(native_kernels, "available", lambda: False)  # where the op runs
    layer = _linear(64, 48, dtype)
    quantize_linears(layer, "int4", mode="auto")
    assert layer.quant_kernel == INT4_MM
    identity = torch.eye(64, dtype=dtype)
    with torch.no_grad():
        seen = int4_mm(identity, layer.qweight, layer.qscale).t()
    assert torch.equal(seen, dequantize_int4(layer.qweight, layer.qscale, int4_layout()).to(dtype))


class _TinyLM4(_TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.odd = Linear(48, 32)  # in_features not a multiple of the group size


def test_int4_skips_parts_and_odd_layers_and_a_tied_lm_head_keeps_the_embedding(kernels):
    model = _TinyLM4()
    embedding = model.embed.weight.detach().clone()
    assert quantize_linears(model, "int4", skip=["vision"]) == 2  # qkv and lm_head
    assert model.vision[0].qweight is None and model.odd.qweight is None and model.odd.weight.shape == (32, 48)
    assert quantized_values(model.qkv)[0].shape == (64, 32) and model.qkv.weight.numel() == 0
    kernel = _expected_int4_kernel(kernels, "auto", torch.float32)
    assert model.qkv.quant_kernel == kernel and model.lm_head.quant_kernel == kernel
    assert quantized_values(model.lm_head)[0].shape == (50, 32)  # 50 outputs, whatever the kernel pads
    assert model.lm_head.weight is model.embed.weight and torch.equal(model.embed.weight, embedding)
    x = torch.randn(3, 32)
    with torch.no_grad():
        ref = F.linear(x.double(), _int4_weight(model.lm_head))
        assert model.lm_head(x).shape == (3, 50)
        assert ((model.lm_head(x).double() - ref).abs() <= _int4_bound(x, model.lm_head, torch.float32)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_weights_take_half_a_byte_and_two_scales_per_group(kernels, dtype):
    model = nn.Sequential(_linear(256, 128, dtype), _linear(128, 256, dtype))
    numel = sum(m.weight.numel() for m in model)
    quantize_linears(model, "int4")
    kept = sum(
        b.numel() * b.element_size() for name, b in model.named_buffers() if name.endswith(("qweight", "qscale"))
    )
    kept += sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name.endswith("weight"))
    size = torch.finfo(dtype).bits // 8
    assert kept == numel // 2 + numel // INT4_GROUP_SIZE * 2 * size  # bfloat16: 5/16 of its bytes, float32: 3/16
