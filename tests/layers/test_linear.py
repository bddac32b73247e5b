"""oneDNN-packed linears and fused projections."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tessera.layers.linear import Linear, MergedLinear, pack_linears_for_cpu

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_packed_linear_computes_the_same_as_dense(dtype, atol, rows):
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True).to(dtype)
    x = torch.randn(2, rows, 64, dtype=dtype)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert pack_linears_for_cpu(layer) == 1
    assert layer.weight.numel() == 0  # the dense copy is dropped
    torch.testing.assert_close(layer(x), expected, atol=atol, rtol=0)


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
