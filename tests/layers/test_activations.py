"""Activations by config name: each one is Hugging Face's function of the same name."""

from __future__ import annotations

import pytest
import torch

from tessera.layers.activations import ACTIVATIONS, get_activation


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_each_activation_is_hugging_faces(name):
    from transformers.activations import ACT2FN

    x = torch.linspace(-6.0, 6.0, 101, dtype=torch.float64)
    torch.testing.assert_close(get_activation(name)(x), ACT2FN[name](x))


def test_an_unknown_activation_names_the_supported_ones():
    with pytest.raises(ValueError, match="Unsupported activation 'swish2'.*sigmoid"):
        get_activation("swish2")
