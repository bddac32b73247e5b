"""Packed linears (Tessera's native kernel or oneDNN, whichever `linear_kernel` picks for the dtype on this
CPU), the F.linear fallback, and fused projections."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tessera.layers import native_kernels
from tessera.layers.cpu_kernels import ENV, FALLBACK, NATIVE, PACKED, linear_kernel, onednn_packs
from tessera.layers.linear import Linear, MergedLinear, pack_linears_for_cpu

DTYPES = [(torch.float32, 1e-4), (torch.bfloat16, 5e-2), (torch.float16, 5e-3)]


@pytest.mark.parametrize("mode", ["auto", "fallback"], ids=["packed", "fallback"])
@pytest.mark.parametrize("dtype, atol", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_linear_computes_the_same_as_dense(monkeypatch, mode, dtype, atol, rows):
    monkeypatch.setenv(ENV, mode)
    kernel = linear_kernel(dtype)
    if mode == "auto" and kernel == FALLBACK:
        cap = torch.backends.cpu.get_cpu_capability()
        pytest.skip(f"this CPU ({cap}) packs {dtype} for no kernel; the fallback case runs it")
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True).to(dtype)
    dense = layer.weight.detach().clone()
    x = torch.randn(2, rows, 64, dtype=dtype)
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(dtype)
    if mode == "auto":
        assert pack_linears_for_cpu(layer) == 1
        assert layer.weight.numel() == 0  # the dense copy is dropped
        assert (layer.native_weight is not None) == (kernel == NATIVE)
        assert (layer.packed_weight is not None) == (kernel == PACKED)
        torch.testing.assert_close(layer(x), expected, atol=atol, rtol=0)
    else:
        assert pack_linears_for_cpu(layer) == 0
        assert layer.packed_weight is None and layer.native_weight is None and torch.equal(layer.weight, dense)
        assert torch.equal(layer(x), F.linear(x, dense, layer.bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packing_follows_the_kernel_choice(monkeypatch, dtype):
    """float32 runs the native kernel where it is built; 16-bit weights too where oneDNN cannot pack them
    (bfloat16 on AVX2-only CPUs) and bfloat16 where the CPU has bf16 dot products, else oneDNN; with neither,
    nothing is packed and the layer still works."""
    monkeypatch.delenv(ENV, raising=False)
    native = native_kernels.available() and (
        dtype == torch.float32
        or not onednn_packs(dtype)
        or (dtype == torch.bfloat16 and native_kernels.has_bf16_dot() and not native_kernels.has_amx())
    )
    expected_kernel = NATIVE if native else PACKED if onednn_packs(dtype) else FALLBACK
    assert linear_kernel(dtype) == expected_kernel
    torch.manual_seed(0)
    layer = Linear(32, 16, bias=False).to(dtype)
    x = torch.randn(5, 32, dtype=dtype)
    expected = F.linear(x.float(), layer.weight.float()).to(dtype)
    assert pack_linears_for_cpu(layer) == int(expected_kernel != FALLBACK)
    torch.testing.assert_close(layer(x), expected, atol=5e-2 if dtype != torch.float32 else 1e-4, rtol=0)


def test_fallback_runs_a_bfloat16_model(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(MergedLinear(16, {"gate_proj": 8, "up_proj": 8}), Linear(16, 4)).to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    expected = model(x)
    monkeypatch.setenv(ENV, "auto")
    assert pack_linears_for_cpu(model, mode="fallback") == 0  # the argument wins over the environment
    monkeypatch.setenv(ENV, "fallback")
    assert pack_linears_for_cpu(model) == 0
    assert torch.equal(model(x), expected)


def test_an_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match="TESSERA_CPU_KERNELS='fast'"):
        pack_linears_for_cpu(nn.Identity())


def test_shared_weights_keep_their_dense_copy():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.head = Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    before = model.embed.weight.detach().clone()
    pack_linears_for_cpu(model)
    assert model.head.weight is model.embed.weight
    torch.testing.assert_close(model.embed.weight, before)
    x = torch.randn(3, 8)
    torch.testing.assert_close(model.head(x), x @ before.T, atol=1e-5, rtol=0)


def test_merged_linear_splits_in_shard_order():
    layer = MergedLinear(4, {"q_proj": 2, "k_proj": 3})
    assert layer.shard_rows() == {"q_proj": slice(0, 2), "k_proj": slice(2, 5)}
    q, k = layer.split(torch.arange(10.0).view(2, 5))
    assert q.tolist() == [[0, 1], [5, 6]] and k.tolist() == [[2, 3, 4], [7, 8, 9]]
