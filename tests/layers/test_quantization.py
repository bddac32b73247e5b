"""Int8 weight-only quantization: the per-channel rounding bound, both kernels against the de-quantized
reference, which layers are quantized and how many bytes they keep."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.config import QUANTIZATION_METHODS, check_quantization
from tessera.layers.cpu_kernels import (
    ENV,
    INT8_DEQUANT,
    INT8_MM,
    INT8_MM_MAX_ROWS,
    PACKED,
    int8_kernel,
    int8_mm_works,
    linear_kernel,
)
from tessera.layers.linear import Linear, MergedLinear, pack_linears_for_cpu
from tessera.layers.quantization import quantize_int8, quantize_linears

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
    assert layer.int8_mm == expect_mm
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


def test_kernel_choice_follows_the_probe_and_the_switch(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    auto = INT8_MM if int8_mm_works(torch.bfloat16) else INT8_DEQUANT
    assert int8_kernel(torch.bfloat16) == auto
    monkeypatch.setenv(ENV, "fallback")
    assert int8_kernel(torch.bfloat16) == INT8_DEQUANT
    assert int8_kernel(torch.float64, "auto") == INT8_DEQUANT  # not a dtype the op takes
    assert int8_kernel(torch.float16, "auto") == INT8_DEQUANT  # it takes it, but never beats de-quantizing


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
    packs = linear_kernel(torch.float32, "auto") == PACKED
    assert pack_linears_for_cpu(model, mode="auto") == packs  # only the float vision linear; quantized ones stay int8
    assert model.qkv.qweight is not None and model.qkv.packed_weight is None
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


@pytest.mark.parametrize("name", ["int4", "fp8", "awq", 8])
def test_unknown_methods_are_refused_with_the_supported_ones(name):
    with pytest.raises(ValueError, match="supported: int8"):
        check_quantization(name)


def test_method_names_are_case_insensitive():
    assert QUANTIZATION_METHODS == ("int8",)
    assert check_quantization("INT8") == "int8" and check_quantization(None) is None
