"""The native CPU kernels (tessera/layers/csrc) against first principles: the packed layout is the dense
weight's blocks of 16 outputs side by side, and `gemv` is x @ w.T (+ bias) summed in float64, on every ISA
path this CPU runs (`make test` runs this file again with ATEN_CPU_CAPABILITY=avx2, the AVX2 path alone)."""

from __future__ import annotations

import pytest
import torch

from tessera.layers import native_kernels as nk

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 5, 3), (1, 16, 32), (2, 33, 17), (3, 40, 100), (8, 64, 576), (9, 70, 31), (17, 48, 64), (40, 100, 64),
          (7, 200, 33), (1, 1000, 20)]  # (M, N, K): tails of rows, blocks and panels


def isa_paths() -> list[int]:
    best = nk.cpu_isa()
    return [isa for isa in (nk.ISA_AVX2, nk.ISA_AVX512) if best is not None and isa <= best]


def test_the_kernels_build_and_load_on_this_cpu():
    assert nk.cpu_isa() is not None, "every machine this project runs on has AVX2 + FMA + F16C"
    assert nk.available(), nk.describe()  # CI builds them from a clean clone: a broken build fails here


def test_atens_capability_caps_the_isa(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert nk.cpu_isa() == nk.ISA_AVX2
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert nk.cpu_isa() is None


def test_the_packed_layout_puts_16_outputs_side_by_side():
    w = torch.arange(35 * 7, dtype=torch.float32).view(35, 7)
    packed = nk.pack_gemv_weight(w)
    assert packed.shape == (3, 7, 16)
    for block in range(3):
        for j in range(16):
            row = block * 16 + j
            expected = w[row] if row < 35 else torch.zeros(7)
            assert torch.equal(packed[block, :, j], expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemv_is_x_times_w_transposed(dtype, shape):
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=gen).to(dtype if dtype != torch.float16 else torch.float32)
    w, bias = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen)
    exact = x.double() @ w.double().T + bias.double()  # the weight's and x's own values, summed exactly
    # float32 products summed in float32: each of the k + 1 additions rounds by at most 2^-24 of what it sums;
    # an output in bfloat16 adds its own rounding (2^-8 relative)
    bound = (k + 1) * 2**-24 * (x.double().abs() @ w.double().abs().T + bias.double().abs())
    if x.dtype != torch.float32:
        bound += 2**-8 * exact.abs()
    packed = nk.pack_gemv_weight(w)
    for isa in isa_paths():
        y = torch.ops.tessera.gemv(x, packed, n, bias, isa)
        assert y.dtype == x.dtype and y.shape == (m, n)
        assert ((y.double() - exact).abs() <= bound).all(), (isa, (y.double() - exact).abs().max())
        assert torch.equal(y, torch.ops.tessera.gemv(x, packed, n, bias, isa))  # deterministic


def test_gemv_without_bias_and_refusals():
    x, w = torch.randn(2, 8), torch.randn(20, 8)
    y = nk.gemv(x, nk.pack_gemv_weight(w), 20)
    assert torch.allclose(y, x @ w.T, atol=1e-5)
    with pytest.raises(ValueError, match="packed weight"):
        nk.gemv(torch.randn(2, 9), nk.pack_gemv_weight(w), 20)  # K does not match
    with pytest.raises(ValueError, match="torch.float64"):
        nk.gemv(x, nk.pack_gemv_weight(w).to(torch.float64), 20)
    with pytest.raises(ValueError, match="bias of 20"):
        nk.gemv(x, nk.pack_gemv_weight(w), 20, torch.zeros(3))


def test_the_bf16_pair_layout_puts_each_k_pair_of_16_outputs_side_by_side():
    w = torch.arange(20 * 5, dtype=torch.float32).view(20, 5).bfloat16()  # small integers: exact in bfloat16
    packed = nk.pack_bf16dot_weight(w)
    assert packed.shape == (2, 3, 16, 2)  # 20 outputs -> 2 blocks, 5 inputs -> 3 pairs (a zero past K)
    for row in range(32):
        for k in range(6):
            expected = w[row, k] if row < 20 and k < 5 else 0
            assert packed[row // 16, k // 2, row % 16, k % 2] == expected


@pytest.mark.skipif(not nk.has_bf16_dot(), reason="this CPU (or ATEN_CPU_CAPABILITY) has no AVX512-BF16")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemv_bf16dot_is_x_times_w_transposed(shape):
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x, w = torch.randn(m, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen)
    exact = x.double() @ w.double().T + bias.double()
    # each instruction adds two exact products to a float32 sum (one rounding per pair, denormals flushed),
    # then the output rounds to bfloat16
    bound = (k + 1) * 2**-24 * (x.double().abs() @ w.double().abs().T + bias.double().abs()) + 2**-8 * exact.abs()
    y = nk.gemv_bf16dot(x, nk.pack_bf16dot_weight(w), n, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert ((y.double() - exact).abs() <= bound + 1e-30).all(), (y.double() - exact).abs().max()
