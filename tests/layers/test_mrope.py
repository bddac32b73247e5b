"""M-RoPE against transformers 5.x (Qwen2-VL / Qwen2.5-VL contiguous sections, Qwen3-VL interleaved)
and against its definition: each frequency turns with the index of its own axis."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import (
    Gemma3TextConfig,
    LlamaConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLTextConfig,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen2VLTextConfig,
    Qwen3VLConfig,
    Qwen3VLTextConfig,
)
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

from tessera.layers.mrope import MRotaryEmbedding, mrope_axis_map, uses_mrope
from tessera.layers.rotary import RotaryEmbedding, get_rope

H, HKV, D = 4, 2, 64  # rotary_dim / 2 = 32 frequencies
SECTION = [8, 12, 12]  # Qwen2-VL's [16, 24, 24] at half the head size
INTERLEAVED_SECTION = [12, 10, 10]  # Qwen3-VL's [24, 20, 20] at half the head size


def qk(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, D, generator=g), torch.randn(n, HKV, D, generator=g)


def random_positions(n, seed=0):
    """[3, T]: text runs (equal rows) and image cells, up to large indices."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 40000, (3, n), generator=g)
    positions[:, :4] = torch.arange(4)  # a text prefix
    return positions


def hf_rotate(hf_rope, positions, q, k):
    """HF's path: cos/sin from the model's rotary class for position_ids [3, 1, T], then
    apply_rotary_pos_emb on [1, heads, T, D]."""
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    cos, sin = hf_rope(qh, positions[:, None, :])
    q_out, k_out = apply_rotary_pos_emb(qh, kh, cos, sin)
    return q_out[0].transpose(0, 1), k_out[0].transpose(0, 1)


def assert_same(ours, theirs, atol=1e-5):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


def text_config(cls, rope_parameters):
    head_dim = {"head_dim": D} if cls is Qwen3VLTextConfig else {}  # its default is 128, not hidden / heads
    return cls(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=HKV, max_position_embeddings=32768,
               rope_parameters=rope_parameters, **head_dim)  # fmt: skip


CASES = {
    "qwen2_vl": (Qwen2VLTextConfig, Qwen2VLRotaryEmbedding, {"rope_type": "default", "mrope_section": SECTION}),
    "qwen2_vl-old-mrope-type": (Qwen2VLTextConfig, Qwen2VLRotaryEmbedding, {"type": "mrope", "mrope_section": SECTION}),
    "qwen2_vl-linear": (
        Qwen2VLTextConfig, Qwen2VLRotaryEmbedding, {"rope_type": "linear", "factor": 2.0, "mrope_section": SECTION},
    ),
    "qwen2_5_vl": (Qwen2_5_VLTextConfig, Qwen2_5_VLRotaryEmbedding, {"rope_type": "default", "mrope_section": SECTION}),
    "qwen3_vl-interleaved": (
        Qwen3VLTextConfig, Qwen3VLTextRotaryEmbedding,
        {"rope_type": "default", "mrope_section": INTERLEAVED_SECTION, "mrope_interleaved": True},
    ),
}  # fmt: skip


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(CASES))
def test_matches_hf_for_three_axis_positions(name):
    config_cls, hf_cls, rope_parameters = CASES[name]
    config = text_config(config_cls, dict(rope_parameters, rope_theta=1000000.0))
    rope = get_rope(config, D)
    assert isinstance(rope, MRotaryEmbedding)
    assert rope.interleaved == name.startswith("qwen3")
    positions = random_positions(40)
    q, k = qk(40)
    assert_same(rope(positions, q, k), hf_rotate(hf_cls(config), positions, q, k))


def test_configs_without_mrope_section_take_hf_model_defaults():
    """HF's classes fall back to [16, 24, 24] (Qwen2-VL) and interleaved [24, 20, 20] (Qwen3-VL)."""
    for config, hf_cls, section, interleaved in [
        (Qwen2VLConfig().get_text_config(), Qwen2VLRotaryEmbedding, (16, 24, 24), False),
        (Qwen3VLConfig().get_text_config(), Qwen3VLTextRotaryEmbedding, (24, 20, 20), True),
    ]:
        config.hidden_size, config.num_attention_heads = 256, 2  # head_dim 128: the sections' size
        rope = get_rope(config, 128)
        assert (rope.mrope_section, rope.interleaved) == (section, interleaved)
        positions = random_positions(12, seed=1)
        q, k = torch.randn(12, H, 128), torch.randn(12, HKV, 128)
        assert_same(rope(positions, q, k), hf_rotate(hf_cls(config), positions, q, k))


@pytest.mark.parametrize("interleaved", [False, True])
def test_text_positions_equal_plain_rope_with_the_same_theta(interleaved):
    section = INTERLEAVED_SECTION if interleaved else SECTION
    params = {"rope_type": "default", "mrope_section": section, "mrope_interleaved": interleaved, "rope_theta": 1e6}
    rope = get_rope(text_config(Qwen2Config, params), D)  # no M-RoPE family: mrope_interleaved decides
    assert rope.interleaved == interleaved
    plain = get_rope(LlamaConfig(hidden_size=H * D, num_attention_heads=H, rope_theta=1e6), D)
    positions = torch.tensor([0, 1, 2, 17, 500, 31999])
    q, k = qk(6)
    expected = plain(positions, q, k)
    assert_same(rope(positions, q, k), expected, atol=0)  # [T]: one index for all axes
    assert_same(rope(positions.expand(3, -1).clone(), q, k), expected, atol=0)  # [3, T] with equal rows


@pytest.mark.parametrize("interleaved", [False, True])
def test_each_frequency_turns_with_its_own_axis(interleaved):
    """From the definition: pair (j, j + R/2) turns by positions[axis(j)] * theta^(-2j/R), where
    axis is t, h, w in contiguous bands, or cycling t h w while the h / w sections last."""
    section = INTERLEAVED_SECTION if interleaved else SECTION
    theta = 10000.0
    params = {"rope_type": "default", "mrope_section": section, "mrope_interleaved": interleaved, "rope_theta": theta}
    rope = get_rope(text_config(Qwen2Config, params), D)  # no M-RoPE family: mrope_interleaved decides
    assert rope.interleaved == interleaved
    if interleaved:
        expected_axis = [1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
                         for j in range(D // 2)]  # fmt: skip
    else:
        expected_axis = [0] * section[0] + [1] * section[1] + [2] * section[2]
    assert mrope_axis_map(tuple(section), interleaved).tolist() == expected_axis
    positions = torch.tensor([[3], [50], [700]])  # one token at t=3, h=50, w=700
    q = torch.zeros(1, 1, D)
    q[..., : D // 2] = 1.0  # each pair (x, 0) -> (cos a, sin a)
    rotated = rope(positions, q, q)[0][0, 0]
    angle = torch.atan2(rotated[D // 2 :], rotated[: D // 2]).double()
    for j, axis in enumerate(expected_axis):
        want = positions[axis, 0].item() * theta ** (-2 * j / D)
        assert abs((angle[j].item() - want + torch.pi) % (2 * torch.pi) - torch.pi) < 1e-3, (j, axis)


def test_the_family_fixes_the_layout_as_its_hf_class_does():
    """Qwen3-VL's class interleaves and Qwen2-VL's does not, whatever mrope_interleaved says."""
    positions = random_positions(16, seed=2)
    q, k = qk(16)
    for cls, hf_cls, flag, interleaved in [
        (Qwen3VLTextConfig, Qwen3VLTextRotaryEmbedding, False, True),
        (Qwen2VLTextConfig, Qwen2VLRotaryEmbedding, True, False),
    ]:
        section = INTERLEAVED_SECTION if cls is Qwen3VLTextConfig else SECTION
        config = text_config(cls, {"rope_type": "default", "mrope_section": section, "mrope_interleaved": flag})
        rope = get_rope(config, D)
        assert rope.interleaved == interleaved
        assert_same(rope(positions, q, k), hf_rotate(hf_cls(config), positions, q, k))


def test_bad_layouts_and_positions_are_refused():
    with pytest.raises(ValueError, match=r"mrope_section \[8, 12, 13\] sums to 33.*32 frequencies"):
        get_rope(text_config(Qwen2VLTextConfig, {"rope_type": "default", "mrope_section": [8, 12, 13]}), D)
    with pytest.raises(ValueError, match="Dynamic NTK.*M-RoPE"):
        get_rope(text_config(Qwen2VLTextConfig, {"rope_type": "dynamic", "factor": 2.0, "mrope_section": SECTION}), D)
    rope = get_rope(text_config(Qwen2VLTextConfig, {"rope_type": "default", "mrope_section": SECTION}), D)
    q, k = qk(5)
    with pytest.raises(ValueError, match=r"\[3, T\] or \[T\], got \(2, 5\)"):
        rope(torch.zeros(2, 5, dtype=torch.long), q, k)
    old_style = SimpleNamespace(rope_scaling={"type": "longrope", "mrope_section": SECTION}, rope_theta=1e6)
    with pytest.raises(ValueError, match="'longrope'.*rope_scaling"):
        get_rope(old_style, D)


def test_uses_mrope():
    assert uses_mrope(Qwen2VLConfig()) and uses_mrope(Qwen2VLConfig().get_text_config())
    assert uses_mrope(Qwen2_5_VLConfig()) and uses_mrope(Qwen2_5_VLConfig().text_config)
    assert uses_mrope(Qwen3VLConfig())
    assert uses_mrope(
        Qwen2VLConfig(text_config={"rope_parameters": {"rope_type": "default", "mrope_section": SECTION}})
    )
    assert not uses_mrope(Qwen2Config())
    assert not uses_mrope(LlamaConfig(rope_parameters={"rope_type": "yarn", "factor": 2.0}))
    assert not uses_mrope(Gemma3TextConfig())
    # a plain Qwen2 config carrying a Qwen2-VL rope: the config asks for M-RoPE whatever its model type
    assert uses_mrope(Qwen2Config(rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24]}))
    assert uses_mrope(SimpleNamespace(rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}))
    assert not uses_mrope(SimpleNamespace(rope_scaling=None, rope_theta=1e4))


def test_a_plain_text_rotary_embedding_refuses_what_uses_mrope_flags():
    config = Qwen2Config(hidden_size=H * D, num_attention_heads=H,
                         rope_parameters={"rope_type": "default", "mrope_section": SECTION})  # fmt: skip
    assert uses_mrope(config)
    with pytest.raises(ValueError, match="M-RoPE"):
        RotaryEmbedding(config, D)


def test_cos_sin_are_computed_once_per_positions_tensor():
    rope = get_rope(text_config(Qwen2VLTextConfig, {"rope_type": "default", "mrope_section": SECTION}), D)
    calls = []
    angles = rope.angles
    rope.angles = lambda positions: calls.append(positions) or angles(positions)
    positions = random_positions(6)
    q, k = qk(6)
    for _ in range(4):
        rope(positions, q, k)
    assert len(calls) == 1


def test_uses_mrope_answers_without_raising_for_an_incomplete_mrope_dict():
    """It only reports what the config asks for; get_rope is where an unusable layout is refused."""
    config = SimpleNamespace(rope_scaling={"type": "mrope"}, rope_theta=1e6)
    assert uses_mrope(config)
    with pytest.raises(ValueError, match="no mrope_section"):
        get_rope(config, D)
