"""The model's KV window: how many of a sequence's last keys any later query may still see."""

from __future__ import annotations

import pytest
from torch import nn

from tessera.layers.attention import PagedAttention
from tessera.layers.kv_cache import kv_window


def model(*windows):
    return nn.ModuleList(PagedAttention(4, 8, 2, 1.0, sliding_window=w) for w in windows)


@pytest.mark.parametrize(
    "windows, expected",
    [((4, 4), 4), ((4, 16, 8), 16), ((4, None), None), ((None, None), None), ((), None)],
)
def test_kv_window_is_the_largest_window_if_every_layer_has_one(windows, expected):
    assert kv_window(model(*windows)) == expected
