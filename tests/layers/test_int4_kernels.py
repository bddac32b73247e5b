"""int4 kernels: the op's nibble layout per CPU capability, packing round trips, and the probes."""

from __future__ import annotations

import pytest
import torch

from tessera.layers import int4_kernels
from tessera.layers.int4_kernels import INT4_LAYOUTS, Int4Layout, int4_layout, int4_mm_works, pack_int4, unpack_int4


def test_int4_layout_is_the_one_of_the_capability():
    """torch packs int4 weights in blocks of 4 float vectors' width (AVX-512: 64 rows, AVX2: 32, both with
    the block's halves in the low and high nibbles), or in row pairs in its scalar (DEFAULT) kernel."""
    expected = {"AVX512": Int4Layout(64, True), "AVX2": Int4Layout(32, True), "DEFAULT": Int4Layout(32, False)}
    capability = torch.backends.cpu.get_cpu_capability()
    layout = int4_layout()
    if capability in expected:
        assert layout == expected[capability]
    else:
        assert layout is None or layout in INT4_LAYOUTS


@pytest.mark.parametrize("rows", [16, 32, 48, 64, 80, 112, 128, 176])  # whole blocks and shorter last ones
def test_int4_values_survive_packing(rows):
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(0, 16, (rows, 64), generator=gen, dtype=torch.uint8)
    portable = pack_int4(q, op_layout=False)
    assert portable.shape == (rows, 32) and torch.equal(portable[:, 0] & 15, q[:, 0])
    assert torch.equal(unpack_int4(portable, None), q)
    if int4_layout() is not None:
        packed = pack_int4(q, op_layout=True)
        assert packed.shape == (rows, 32) and torch.equal(unpack_int4(packed, int4_layout()), q)


@pytest.mark.skipif(int4_layout() is None, reason="torch's int4 CPU op does not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_int4_probe_passes_here_and_catches_a_wrong_kernel(monkeypatch, dtype):
    assert int4_mm_works.__wrapped__(dtype)  # exact on AVX-512, AVX2 (`make test`'s second run) and DEFAULT
    real = int4_kernels.int4_mm
    monkeypatch.setattr(int4_kernels, "int4_mm", lambda x, *args: real(x, *args) * 1.0078125)  # one bf16 ulp off
    assert not int4_mm_works.__wrapped__(dtype)
    monkeypatch.setattr(int4_kernels, "int4_mm", lambda x, *args: real(x[:, :-1].contiguous(), *args))  # raises
    assert not int4_mm_works.__wrapped__(dtype)


def test_the_int4_layout_probe_refuses_an_unknown_layout(monkeypatch):
    monkeypatch.setattr(int4_kernels, "pack_int4", lambda q, op_layout: q.flip(0)[:, ::2] | (q.flip(0)[:, 1::2] << 4))
    assert int4_layout.__wrapped__() is None
    monkeypatch.setattr(int4_kernels, "pack_int4", lambda q, op_layout: 1 / 0)
    assert int4_layout.__wrapped__() is None


def test_the_int4_probes_leave_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    int4_layout.__wrapped__()
    int4_mm_works.__wrapped__(torch.bfloat16)
    assert torch.equal(torch.rand(2), expected)
