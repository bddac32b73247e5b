"""Kernel choice per dtype: the probes, the TESSERA_CPU_KERNELS switch, the start-up line."""

from __future__ import annotations

import os

import pytest
import torch

from tessera.layers import native_kernels
from tessera.layers.cpu_kernels import (
    ENV,
    FALLBACK,
    NATIVE,
    PACKED,
    describe_cpu_kernels,
    linear_kernel,
    onednn_packs,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def auto_kernel(dtype: torch.dtype) -> str:
    """The native kernel for float32, for 16-bit weights oneDNN cannot pack, and for bfloat16 where the CPU has
    bf16 dot products; else oneDNN where it packs."""
    bf16_dot = dtype == torch.bfloat16 and native_kernels.has_bf16_dot() and not native_kernels.has_amx()
    if native_kernels.available() and (dtype == torch.float32 or not onednn_packs(dtype) or bf16_dot):
        return NATIVE
    return PACKED if onednn_packs(dtype) else FALLBACK


@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_follows_the_probe_and_fallback_overrides_it(monkeypatch, dtype):
    monkeypatch.delenv(ENV, raising=False)
    auto = auto_kernel(dtype)
    assert linear_kernel(dtype) == linear_kernel(dtype, "auto") == auto
    monkeypatch.setenv(ENV, "fallback")
    assert linear_kernel(dtype) == FALLBACK
    assert linear_kernel(dtype, "auto") == auto  # the argument wins over the environment
    monkeypatch.delenv(ENV)
    assert linear_kernel(dtype) == auto  # the switch is not cached


def test_other_dtypes_fall_back(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert linear_kernel(torch.float64) == FALLBACK


AVX2_EMULATION = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2"


@pytest.mark.skipif(not AVX2_EMULATION, reason="only under ONEDNN_MAX_CPU_ISA=AVX2 (make test's second run)")
def test_avx2_only_cpus_do_not_pack_bfloat16():
    """`make test` reruns tests/layers with ONEDNN_MAX_CPU_ISA=AVX2, as on AMD Zen 3."""
    assert not onednn_packs(torch.bfloat16)


def test_the_probe_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    onednn_packs.__wrapped__(torch.bfloat16)
    assert torch.equal(torch.rand(2), expected)


def test_describe_names_the_capability_and_each_dtype(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    line = describe_cpu_kernels()
    assert line.startswith(f"CPU kernels (auto): capability {torch.backends.cpu.get_cpu_capability()}, linear ")
    assert f"float32={linear_kernel(torch.float32)} bfloat16={linear_kernel(torch.bfloat16)}" in line
    monkeypatch.setenv(ENV, "fallback")
    line = describe_cpu_kernels()
    assert line.startswith("CPU kernels (fallback): ") and PACKED not in line and f"={NATIVE}" not in line
