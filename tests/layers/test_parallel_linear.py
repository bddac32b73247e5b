"""Column-, merged- and row-parallel linears on two gloo ranks (a thread each): each rank's slice, cut
from the full weights by `shard_weight`, gives the full layer's output (whole for row-parallel, this
rank's columns for column-parallel), as plain torch computes it."""

from __future__ import annotations

import pytest
import torch

from tessera.distributed import tensor_parallel_group
from tessera.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from testkit.distributed import run_on_ranks, thread_groups


@pytest.fixture(scope="module")
def groups():
    return thread_groups(2)


def build(groups, make, full_params: dict[str, torch.Tensor]):
    """The layer on every rank, its parameters cut from the full ones."""
    layers = []
    for group in groups:
        with tensor_parallel_group(group):
            layer = make()
        for name, tensor in full_params.items():
            getattr(layer, name).data.copy_(layer.shard_weight(name, tensor))
        layers.append(layer)
    return layers


@pytest.mark.parametrize("bias", [False, True])
def test_column_parallel_gives_each_rank_its_outputs(groups, bias):
    torch.manual_seed(0)
    full = torch.nn.Linear(8, 6, bias=bias)
    params = {"weight": full.weight.detach()} | ({"bias": full.bias.detach()} if bias else {})
    layers = build(groups, lambda: ColumnParallelLinear(8, 6, bias=bias), params)
    x = torch.randn(5, 8)
    outs = run_on_ranks(groups, lambda g: layers[g.rank](x))
    torch.testing.assert_close(torch.cat(outs, dim=-1), full(x), rtol=0, atol=1e-6)


def test_merged_column_parallel_splits_every_projection(groups):
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    layers = []
    for group in groups:
        with tensor_parallel_group(group):
            layer = MergedColumnParallelLinear(8, {"q_proj": 8, "k_proj": 4, "v_proj": 4})
        rows = layer.shard_rows()
        for name, tensor in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            layer.weight.data[rows[name]] = layer.shard_weight("weight", tensor)
        layers.append(layer)
    assert layers[0].shards == {"q_proj": 4, "k_proj": 2, "v_proj": 2}
    x = torch.randn(3, 8)
    for rank, (oq, ok, ov) in enumerate(run_on_ranks(groups, lambda g: layers[g.rank].split(layers[g.rank](x)))):
        for out, full, width in ((oq, q, 4), (ok, k, 2), (ov, v, 2)):
            torch.testing.assert_close(out, x @ full[rank * width : (rank + 1) * width].T, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_parallel_sums_the_ranks_and_adds_the_bias_once(groups, dtype):
    torch.manual_seed(0)
    full = torch.nn.Linear(8, 6, bias=True).to(dtype)
    params = {"weight": full.weight.detach(), "bias": full.bias.detach()}
    layers = build(groups, lambda: RowParallelLinear(8, 6, bias=True).to(dtype), params)
    assert torch.equal(layers[1].bias, torch.zeros(6, dtype=dtype))
    x = torch.randn(5, 8, dtype=dtype)
    outs = run_on_ranks(groups, lambda g: layers[g.rank](x.chunk(2, dim=-1)[g.rank]))
    tolerance = 1e-6 if dtype == torch.float32 else 3e-2
    for out in outs:
        torch.testing.assert_close(out, full(x), rtol=0, atol=tolerance)


def test_a_width_that_does_not_split_is_refused(groups):
    with tensor_parallel_group(groups[0]), pytest.raises(ValueError, match=r"out_features \(5\) is not divisible"):
        ColumnParallelLinear(8, 5)
