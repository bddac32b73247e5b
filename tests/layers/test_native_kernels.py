"""The native CPU kernels (tessera/layers/csrc) against first principles: the packed layout is the dense
weight's blocks of 16 outputs side by side, and `gemv` is x @ w.T (+ bias) summed in float64, on every ISA
path this CPU runs (`make test` runs this file again with ATEN_CPU_CAPABILITY=avx2, the AVX2 path alone)."""

from __future__ import annotations

import functools

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


# --- int8 / int4 weights: integer dot products ------------------------------------------------------------------

QUANT_SHAPES = [(1, 20, 64, 32), (2, 100, 96, 96), (3, 33, 64, 64), (5, 40, 1024, 512), (9, 576, 576, 32),
                (17, 48, 128, 32), (1, 1000, 32, 32), (2, 32, 120, 12), (3, 40, 80, 40)]
# (M, N, K, G): tails of rows, blocks and panels; G up to 512, and groups x is quantized in with a tail (12, 40)


def quant_isa_paths() -> list[int]:
    best = nk.quant_isa()
    return [isa for isa in (nk.ISA_AVX2, nk.ISA_AVX512) if best is not None and isa <= best]


def test_the_quantized_layouts_put_16_outputs_side_by_side():
    q = torch.arange(-60, 60, dtype=torch.int8)[: 20 * 6].view(20, 6)
    scale = torch.arange(40, dtype=torch.float32).view(20, 2)  # 2 groups of 3... K / G must be 6 / 3
    packed, scales = nk.pack_int8(q, scale)
    assert packed.shape == (2, 3, 16, 2) and scales.shape == (2, 2, 16)
    for row in range(32):
        for k in range(6):
            assert packed[row // 16, k // 2, row % 16, k % 2] == (q[row, k] if row < 20 else 0)
        for g in range(2):
            assert scales[row // 16, g, row % 16] == (scale[row, g] if row < 20 else 0)
    q4 = torch.randint(0, 16, (20, 8), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed, scales = nk.pack_int4(q4, scale, -scale)
    assert packed.shape == (2, 2, 16, 2) and scales.shape == (2, 2, 2, 16)
    for row in range(20):
        for t in range(2):  # of k 4t..4t+3: byte 0 holds 4t (low) and 4t + 2 (high), byte 1 4t + 1 and 4t + 3
            for byte in range(2):
                value = int(packed[row // 16, t, row % 16, byte])
                assert (value & 15, value >> 4) == (int(q4[row, 4 * t + byte]), int(q4[row, 4 * t + 2 + byte]))
        for g in range(2):
            block, lane = row // 16, row % 16
            assert scales[block, g, 0, lane] == scale[row, g] and scales[block, g, 1, lane] == -scale[row, g]


def test_one_scale_per_output_is_repeated_over_groups_the_kernel_sums_in_int32():
    q, scale = torch.ones(3, 1536, dtype=torch.int8), torch.tensor([1.0, 2.0, 3.0])
    _, scales = nk.pack_int8(q, scale)
    assert scales.shape == (1, 3, 16) and (scales[0, :, :3] == scale).all()  # 1536 = 3 groups of 512


def _x_error(x: torch.Tensor, w_abs: torch.Tensor, groups: int) -> torch.Tensor:
    """At most what x's int16 rounding (max |x| of the group / 65534 an element) moves each output by."""
    m, k = x.shape
    amax = x.double().abs().view(m, groups, -1).amax(dim=-1) / 65534
    return amax @ w_abs.view(w_abs.shape[0], groups, -1).sum(dim=-1).T


@pytest.mark.parametrize("scale_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", QUANT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemv_int8_and_int4_are_x_times_the_dequantized_weight(shape, x_dtype, scale_dtype):
    m, n, k, g = shape
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    x[0, 1] = 300  # an outlier: only its group's int16 step grows
    bias = torch.randn(n, generator=gen)
    scale = (torch.rand(n, k // g, generator=gen) / 50).to(scale_dtype)
    zero = (torch.randn(n, k // g, generator=gen) / 50).to(scale_dtype)
    q8 = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    q4 = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    s, z = (t.double().repeat_interleave(g, dim=1) for t in (scale, zero))
    int4_as_gguf = functools.partial(torch.ops.tessera.gemv_int4, zero_point=0)
    cases = {  # the forms of Tessera's own quantizers, and those that hold a GGUF file's blocks
        "int8": (q8.double() * s, nk.pack_int8(q8, scale), torch.ops.tessera.gemv_int8),
        "int8 + zero": (q8.double() * s + z, nk.pack_int8(q8, scale, zero), torch.ops.tessera.gemv_int8),
        "int4": ((q4.double() - 8) * s + z, nk.pack_int4(q4, scale, zero), torch.ops.tessera.gemv_int4),
        "int4, zero point 0": (q4.double() * s + z, nk.pack_int4(q4, scale, zero), int4_as_gguf),
    }
    for name, (w, (packed, scales), op) in cases.items():
        exact = x.double() @ w.T + bias.double()
        # float32: each weight (int4: z - 8 s once a group) and sum rounds by 2^-24 of what it holds (k + 3
        # roundings at most), an output in bfloat16 by 2^-8 of itself; and x's int16 rounding
        magnitude = x.double().abs() @ w.abs().T + bias.double().abs()
        bound = (k + 3) * 2**-24 * magnitude + _x_error(x, w.abs(), k // g) + 1e-30
        if x_dtype != torch.float32:
            bound += 2**-8 * exact.abs()
        for isa in quant_isa_paths():
            y = op(x, packed, scales, n, bias, isa)
            assert y.dtype == x_dtype and y.shape == (m, n)
            assert ((y.double() - exact).abs() <= bound).all(), (name, isa, (y.double() - exact).abs().max())
            assert torch.equal(y, op(x, packed, scales, n, bias, isa))  # deterministic


def test_int16_x_is_far_finer_than_bfloat16_rounding():
    """The int16 step of x (max |x| / 32767) against a bfloat16 x's own rounding of its largest value (2^-9 of
    it): a product of the integer kernels is as close to the exact one as bfloat16 x allows."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 256, generator=gen), torch.randint(-127, 128, (64, 256), generator=gen, dtype=torch.int8)
    scale = torch.full((64, 8), 0.01)
    packed, scales = nk.pack_int8(w, scale)
    exact = x.double() @ (w.double() * 0.01).T
    via_int16 = (nk.gemv_int8(x, packed, scales, 64).double() - exact).abs().max()
    via_bf16 = (x.bfloat16().double() @ (w.double() * 0.01).T - exact).abs().max()
    assert via_int16 * 20 < via_bf16


def test_quantized_refusals():
    q, scale = torch.zeros(20, 64, dtype=torch.int8), torch.ones(20, 2)
    packed, scales = nk.pack_int8(q, scale)
    with pytest.raises(ValueError, match="packed weight"):
        nk.gemv_int8(torch.randn(2, 66), packed, scales, 20)  # K does not match
    with pytest.raises(ValueError, match="groups G of a multiple of 2 inputs up to 512"):
        nk.gemv_int8(torch.randn(2, 64), packed, scales[:, :1].expand(2, 3, 16).contiguous(), 20)  # 3 groups of 64
    with pytest.raises(ValueError, match="groups G of a multiple of 2 inputs up to 512"):
        nk.gemv_int8(torch.randn(1, 1024), *nk.pack_int8(torch.zeros(4, 1024, dtype=torch.int8), torch.ones(4, 1)), 4)
    packed4, scales4 = nk.pack_int4(torch.zeros(20, 64, dtype=torch.uint8), scale, scale)
    with pytest.raises(ValueError, match="torch.uint8"):
        nk.gemv_int4(torch.randn(2, 64), packed4.to(torch.int8), scales4, 20)
    with pytest.raises(ValueError, match="bias of 20"):
        nk.gemv_int4(torch.randn(2, 64), packed4, scales4, 20, torch.zeros(3))


def test_quant_isa_needs_vnni_for_avx512(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert nk.quant_isa() == nk.ISA_AVX2
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    vnni = nk.cpu_isa() == nk.ISA_AVX512 and "avx512_vnni" in nk._cpu_flags()
    assert nk.quant_isa() == (nk.ISA_AVX512 if vnni else nk.cpu_isa())
