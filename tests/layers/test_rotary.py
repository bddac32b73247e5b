"""Rotary embeddings from their defining properties."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, PersimmonConfig

from tessera.layers.rotary import RotaryEmbedding


def rotate(rope, positions, x):
    return rope(torch.tensor(positions), x, x[:, :1])[0]


def test_position_zero_is_identity_and_norms_are_kept():
    rope = RotaryEmbedding(LlamaConfig(hidden_size=32, num_attention_heads=4), head_dim=8)
    x = torch.randn(3, 4, 8)
    torch.testing.assert_close(rotate(rope, [0, 0, 0], x), x)
    rotated = rotate(rope, [1, 7, 300], x)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    assert not torch.allclose(rotated, x)


def test_scores_depend_only_on_the_distance():
    rope = RotaryEmbedding(LlamaConfig(hidden_size=32, num_attention_heads=4), head_dim=8)
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)

    def score(m, n):
        return (rotate(rope, [m], q) * rotate(rope, [n], k)).sum()

    torch.testing.assert_close(score(5, 2), score(103, 100), atol=1e-5, rtol=0)
    assert not torch.isclose(score(5, 2), score(5, 4))


def test_partial_rotary_leaves_the_tail_untouched():
    config = PersimmonConfig(hidden_size=32, num_attention_heads=4, partial_rotary_factor=0.5)
    rope = RotaryEmbedding(config, head_dim=8)
    x = torch.randn(2, 4, 8)
    rotated = rotate(rope, [3, 9], x)
    torch.testing.assert_close(rotated[..., 4:], x[..., 4:])
    assert not torch.allclose(rotated[..., :4], x[..., :4])


def test_dynamic_scaling_is_refused():
    config = LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="Unsupported rope_scaling type 'dynamic'"):
        RotaryEmbedding(config, head_dim=8)


def test_an_mrope_config_is_refused_not_run_with_one_dimensional_positions():
    """transformers rewrites Qwen2-VL's rope type "mrope" to "default" (keeping mrope_section): a
    plain rotary embedding would run it with wrong positions, silently."""
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig(rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}, hidden_size=32,
                           num_attention_heads=4)  # fmt: skip
    text_config = config.get_text_config()
    scaling = text_config.rope_scaling
    assert scaling.get("rope_type", scaling.get("type")) == "default" and "mrope_section" in scaling
    with pytest.raises(ValueError, match=r"M-RoPE \(mrope_section \[2, 1, 1\]\)"):
        RotaryEmbedding(text_config, head_dim=8)
