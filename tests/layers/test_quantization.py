"""Weight-only quantization (int8 per channel, int4 per group): the rounding bounds, both kernels against the
de-quantized reference, which layers are quantized and how many bytes they keep."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import QUANTIZATION_METHODS, check_quantization
from tessera.layers.cpu_kernels import (
    DEQUANT,
    ENV,
    INT8_MM,
    INT8_MM_MAX_ROWS,
    NATIVE,
    PACKED,
    int8_kernel,
    int8_mm_works,
    linear_kernel,
)
from tessera.layers.int4_kernels import (
    INT4_MM,
    INT4_MM_MAX_ROWS,
    dequantize_int4,
    int4_kernel,
    int4_layout,
    int4_mm,
    int4_mm_works,
    unpack_int4,
)
from tessera.layers.linear import Linear, MergedLinear, pack_linears_for_cpu
from tessera.layers.quantization import INT4_GROUP_SIZE, quantize_int4, quantize_int8, quantize_linears

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _linear(in_features: int, out_features: int, dtype: torch.dtype, bias: bool = True, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias).to(dtype)
    with torch.no_grad():  # rows of very different magnitudes: each needs its own scale
        layer.weight.mul_(torch.logspace(-3, 1, out_features)[:, None].to(dtype))
    return layer


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_error_is_at_most_half_a_scale_per_channel(dtype):
    weight = torch.randn(48, 96) * torch.logspace(-2, 2, 48)[:, None]  # float16 scales stay normal
    weight[3] = 0  # an all-zero row
    weight = weight.to(dtype)
    q, scale = quantize_int8(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape and scale.shape == (48,) and scale.dtype == dtype
    error = (weight.double() - q.double() * scale.double()[:, None]).abs()
    assert (error <= scale.double()[:, None] / 2 * (1 + 1e-6)).all()
    assert q.abs().max() <= 127
    nonzero = torch.ones(48, dtype=torch.bool)
    nonzero[3] = False
    assert (q.abs().amax(dim=1)[nonzero] >= 126).all()  # each row uses the whole range
    assert (q[3] == 0).all()


def _reference(x: torch.Tensor, layer: Linear) -> torch.Tensor:
    weight = layer.qweight.double() * layer.qscale.double()[:, None]
    bias = None if layer.bias is None else layer.bias.double()
    return F.linear(x.double(), weight, bias)


@pytest.mark.parametrize("mode", ["auto", "fallback"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 40])  # 3 (float32), 40: past INT8_MM_MAX_ROWS, de-quantized under auto
@pytest.mark.parametrize("in_features", [64, 40])  # 40: not a multiple of 16, never the int8 kernel
def test_quantized_linear_equals_the_dequantized_matmul(mode, dtype, rows, in_features):
    layer = _linear(in_features, 20, dtype)
    assert quantize_linears(layer, "int8", mode=mode) == 1
    assert layer.weight.numel() == 0 and layer.qweight.dtype == torch.int8
    expect_mm = mode == "auto" and in_features % 16 == 0 and dtype in INT8_MM_MAX_ROWS and int8_mm_works(dtype)
    assert layer.quant_mm == expect_mm and layer.quantization == "int8"
    x = torch.randn(2, rows, in_features).to(dtype)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (2, rows, 20) and out.dtype == dtype
    ref = _reference(x, layer)
    # Rounding to `dtype` (the output, and the de-quantized weight on that path), float32 sums elsewhere.
    eps = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-10}[dtype]
    magnitude = F.linear(x.double().abs(), (layer.qweight.double() * layer.qscale.double()[:, None]).abs())
    bound = eps * (magnitude + layer.bias.double().abs()) + 1e-30
    assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_int8_kernel_takes_unaligned_inputs(dtype):
    if not int8_mm_works(dtype):
        pytest.skip(f"aten._weight_int8pack_mm does not run {dtype} here")
    layer = _linear(64, 8, dtype, bias=False)
    quantize_linears(layer, "int8", mode="auto")
    base = torch.randn(3 * 64 + 1).to(dtype)
    x = base[1:].view(3, 64)  # starts 1 element past an aligned allocation
    with torch.no_grad():
        out = layer(x)
    torch.testing.assert_close(out.double(), _reference(x, layer), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_kernel_choice_follows_the_probe_and_the_switch(monkeypatch, method):
    kernel, works, op = (
        (int8_kernel, int8_mm_works, INT8_MM) if method == "int8" else (int4_kernel, int4_mm_works, INT4_MM)
    )
    monkeypatch.delenv(ENV, raising=False)
    assert kernel(torch.bfloat16) == (op if works(torch.bfloat16) else DEQUANT)
    monkeypatch.setenv(ENV, "fallback")
    assert kernel(torch.bfloat16) == DEQUANT
    assert kernel(torch.float64, "auto") == DEQUANT  # not a dtype the op takes
    assert kernel(torch.float16, "auto") == DEQUANT  # it takes it, but never beats de-quantizing


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.qkv = MergedLinear(32, {"q": 32, "k": 16, "v": 16})
        self.vision = nn.Sequential(Linear(32, 32))
        self.lm_head = Linear(32, 50, bias=False)
        self.lm_head.weight = self.embed.weight  # tied


def test_skipped_parts_stay_float_and_a_tied_lm_head_keeps_the_embedding():
    model = _TinyLM()
    embedding = model.embed.weight.detach().clone()
    assert quantize_linears(model, "int8", skip=["vision"]) == 2  # qkv and lm_head
    assert model.vision[0].qweight is None and model.vision[0].weight.shape == (32, 32)
    assert model.qkv.qweight.shape == (64, 32) and model.qkv.weight.numel() == 0
    assert model.lm_head.qweight.shape == (50, 32)
    assert model.lm_head.weight is model.embed.weight and torch.equal(model.embed.weight, embedding)
    packs = linear_kernel(torch.float32, "auto") in (PACKED, NATIVE)
    assert pack_linears_for_cpu(model, mode="auto") == packs  # only the float vision linear; quantized ones stay int8
    assert model.qkv.qweight is not None and model.qkv.packed_weight is None and model.qkv.native_weight is None
    assert quantize_linears(model, None) == 0
    assert quantize_linears(model, "int8") == (0 if packs else 1)  # quantized ones once; a packed one never


def test_int8_weights_take_a_quarter_of_float32_bytes():
    model = nn.Sequential(_linear(256, 128, torch.float32), _linear(128, 256, torch.float32))
    dense = sum(m.weight.numel() * 4 for m in model)
    quantize_linears(model, "int8")
    kept = sum(
        b.numel() * b.element_size() for name, b in model.named_buffers() if name.endswith(("qweight", "qscale"))
    )
    kept += sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name.endswith("weight"))
    assert dense / 4 <= kept <= dense / 4 * (1 + 4 / 128)  # int8 values + one float32 scale per row of >= 128


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
    """A quantized layer's exact de-quantized weight [out, in] (float64), without the op's padding rows."""
    unpacked = unpack_int4(layer.qweight, int4_layout() if layer.quant_mm else None)
    return _int4_dequantized(unpacked, layer.qscale)[: layer.out_features]


def _int4_bound(x: torch.Tensor, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
    """What separates `layer(x)` from the exact product with its de-quantized weight: the op and the
    fallback both round each weight once to float32 (2^-24 relative), sum in float32 (<= in_features * 2^-24
    of the sum of |terms|, the classic bound for any order), round the sum to `dtype` and add the bias in
    `dtype` (one half-ulp each); 16-bit inputs of more rows than the op takes round each weight to `dtype`
    first (one more half-ulp)."""
    weight = _int4_weight(layer)
    magnitude = F.linear(x.double().abs(), weight.abs())
    if layer.bias is not None:
        magnitude = magnitude + layer.bias.double().abs()
    unit = torch.finfo(dtype).eps / 2
    rounded_weight = dtype != torch.float32 and x.reshape(-1, x.shape[-1]).shape[0] > INT4_MM_MAX_ROWS.get(dtype, 0)
    return ((layer.in_features + 1) * 2**-24 + (3 if rounded_weight else 2) * unit) * magnitude + 1e-30


@pytest.mark.parametrize("mode", ["auto", "fallback"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 150])  # 300 rows (2 x 150): past INT4_MM_MAX_ROWS, de-quantized under auto
@pytest.mark.parametrize("shape", [(96, 48), (64, 20)])  # 96: 3 groups; 20 outputs: padded to 32 for the op
def test_int4_linear_equals_the_dequantized_matmul(mode, dtype, rows, shape):
    in_features, out_features = shape
    layer = _linear(in_features, out_features, dtype)
    assert quantize_linears(layer, "int4", mode=mode) == 1
    assert layer.weight.numel() == 0 and layer.qweight.dtype == torch.uint8 and layer.quantization == "int4"
    expect_mm = mode == "auto" and dtype in INT4_MM_MAX_ROWS and int4_mm_works(dtype)
    assert layer.quant_mm == expect_mm
    padded = -(-out_features // 16) * 16 if expect_mm else out_features
    assert layer.qweight.shape == (padded, in_features // 2) and layer.qscale.shape == (in_features // 32, padded, 2)
    assert (layer.qscale[:, out_features:] == 0).all()  # padding rows de-quantize to 0
    x = torch.randn(2, rows, in_features).to(dtype)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (2, rows, out_features) and out.dtype == dtype
    ref = F.linear(x.double(), _int4_weight(layer), layer.bias.double())
    assert ((out.double() - ref).abs() <= _int4_bound(x, layer, dtype)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_fallback_matches_auto(monkeypatch, dtype):
    """The same quantized values either way; the outputs differ only in the order of float32 sums (and the
    roundings after them), so each is within `_int4_bound` of the exact product and they of each other."""
    monkeypatch.setenv(ENV, "fallback")
    fallback = _linear(128, 64, dtype)
    quantize_linears(fallback, "int4")
    monkeypatch.delenv(ENV)
    auto = _linear(128, 64, dtype)
    quantize_linears(auto, "int4")
    assert not fallback.quant_mm and auto.quant_mm == (dtype in INT4_MM_MAX_ROWS and int4_mm_works(dtype))
    assert torch.equal(fallback.qscale, auto.qscale)  # 64 outputs: no padding
    assert torch.equal(_int4_weight(fallback), _int4_weight(auto))
    for rows in (1, 3, 33, 300):
        x = torch.randn(rows, 128).to(dtype)
        with torch.no_grad():
            a, b = auto(x), fallback(x)
        assert ((a.double() - b.double()).abs() <= 2 * _int4_bound(x, auto, dtype)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int4_fallback_dequantizes_bit_for_bit_as_the_op(dtype):
    """Fed the identity, the op returns the weight it de-quantized (1 * w, sums with zeros: exact) rounded
    to `dtype`: equal to `dequantize_int4` (one fused multiply-add, as the op) rounded to `dtype`, with
    scales and zeros of any bits (float32 ones round (q - 8) * scale + zero: unfused would differ)."""
    if not int4_mm_works(dtype):
        pytest.skip(f"aten._weight_int4pack_mm_for_cpu does not run {dtype} here")
    layer = _linear(64, 48, dtype)
    quantize_linears(layer, "int4", mode="auto")
    identity = torch.eye(64, dtype=dtype)
    with torch.no_grad():
        seen = int4_mm(identity, layer.qweight, layer.qscale).t()
    assert torch.equal(seen, dequantize_int4(layer.qweight, layer.qscale, int4_layout()).to(dtype))


class _TinyLM4(_TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.odd = Linear(48, 32)  # in_features not a multiple of the group size


def test_int4_skips_parts_and_odd_layers_and_a_tied_lm_head_keeps_the_embedding():
    model = _TinyLM4()
    embedding = model.embed.weight.detach().clone()
    assert quantize_linears(model, "int4", skip=["vision"]) == 2  # qkv and lm_head
    assert model.vision[0].qweight is None and model.odd.qweight is None and model.odd.weight.shape == (32, 48)
    assert model.qkv.qweight.shape == (64, 16) and model.qkv.weight.numel() == 0
    assert model.qkv.quant_mm == (int4_kernel(torch.float32) == INT4_MM)
    lm_head_mm = int4_kernel(torch.float32) == INT4_MM
    assert model.lm_head.quant_mm == lm_head_mm
    assert model.lm_head.qweight.shape == (64 if lm_head_mm else 50, 16)  # 50 outputs, padded for the op
    assert model.lm_head.weight is model.embed.weight and torch.equal(model.embed.weight, embedding)
    x = torch.randn(3, 32)
    with torch.no_grad():
        ref = F.linear(x.double(), _int4_weight(model.lm_head))
        assert model.lm_head(x).shape == (3, 50)
        assert ((model.lm_head(x).double() - ref).abs() <= _int4_bound(x, model.lm_head, torch.float32)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_weights_take_half_a_byte_and_two_scales_per_group(dtype):
    model = nn.Sequential(_linear(256, 128, dtype), _linear(128, 256, dtype))
    numel = sum(m.weight.numel() for m in model)
    quantize_linears(model, "int4")
    kept = sum(
        b.numel() * b.element_size() for name, b in model.named_buffers() if name.endswith(("qweight", "qscale"))
    )
    kept += sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name.endswith("weight"))
    size = torch.finfo(dtype).bits // 8
    assert kept == numel // 2 + numel // INT4_GROUP_SIZE * 2 * size  # bfloat16: 5/16 of its bytes, float32: 3/16
