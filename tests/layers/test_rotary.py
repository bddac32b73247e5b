"""1-D rotary embeddings against transformers 5.x (each model's own rotary class + its
apply_rotary_pos_emb) and against their defining properties."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, PersimmonConfig, Qwen2VLConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.persimmon.modeling_persimmon import PersimmonRotaryEmbedding

from tessera.layers.rotary import RotaryEmbedding, get_rope

H, HKV, D = 4, 2, 64
# small, around the original contexts used below (2048 / 4096 / 8192), and far past them
POSITIONS = [0, 1, 7, 300, 2047, 2048, 4095, 4096, 8191, 9000, 30000, 131071]


def qk(n, head_dim=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, head_dim, generator=g), torch.randn(n, HKV, head_dim, generator=g)


def hf_rotate(hf_rope, positions, q, k, rotary_dim=None, **forward_kwargs):
    """HF's path: cos/sin from the model's rotary class, apply_rotary_pos_emb on [1, heads, T, D],
    only the first rotary_dim features for partial rotary (as Persimmon's attention does)."""
    rotary_dim = rotary_dim or q.shape[-1]
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # [1, heads, T, D]
    cos, sin = hf_rope(qh, positions[None], **forward_kwargs)
    q_rot, k_rot = apply_rotary_pos_emb(qh[..., :rotary_dim], kh[..., :rotary_dim], cos, sin)
    q_out = torch.cat((q_rot, qh[..., rotary_dim:]), dim=-1)
    k_out = torch.cat((k_rot, kh[..., rotary_dim:]), dim=-1)
    return q_out[0].transpose(0, 1), k_out[0].transpose(0, 1)


def assert_same(ours, theirs):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def llama_config(rope_parameters, max_position_embeddings=4096, **kwargs):
    return LlamaConfig(
        hidden_size=H * D, num_attention_heads=H, num_key_value_heads=HKV,
        max_position_embeddings=max_position_embeddings, rope_parameters=rope_parameters, **kwargs,
    )  # fmt: skip


ROPES = {
    "default": ({"rope_type": "default", "rope_theta": 500000.0}, 4096),
    "linear": ({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, 4096),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "rope_theta": 1e6}, 16384),
    "yarn-attention-factor-betas-no-truncate": (
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "attention_factor": 0.8,
         "beta_fast": 16, "beta_slow": 2, "truncate": False, "rope_theta": 10000.0}, 16384,
    ),
    "yarn-mscale (DeepSeek)": (
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
         "mscale_all_dim": 0.707, "rope_theta": 10000.0}, 163840,
    ),
    "yarn-factor-from-context-ratio": (
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096, "rope_theta": 10000.0}, 32768,
    ),
    "llama3": (
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192, "rope_theta": 500000.0}, 131072,
    ),
    # Gemma 4's full-attention layers: a quarter of the frequencies turn, over the whole head
    "proportional": ({"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}, 4096),
    "proportional-factor": (
        {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0, "rope_theta": 1e4}, 4096,
    ),
}  # fmt: skip


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", list(ROPES))
def test_each_rope_type_matches_hf(name):
    rope_parameters, max_positions = ROPES[name]
    config = llama_config(dict(rope_parameters), max_positions)
    positions = torch.tensor(POSITIONS)
    q, k = qk(len(positions))
    rope = get_rope(config, D)
    assert isinstance(rope, RotaryEmbedding) and rope.rope_type == rope_parameters["rope_type"]
    assert_same(rope(positions, q, k), hf_rotate(LlamaRotaryEmbedding(config), positions, q, k))


def test_bf16_matches_hf_in_bf16():
    config = llama_config({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    positions = torch.tensor(POSITIONS[:6])
    q, k = (x.bfloat16() for x in qk(len(positions)))
    ours = get_rope(config, D)(positions, q, k)
    assert ours[0].dtype == torch.bfloat16
    assert_same(ours, hf_rotate(LlamaRotaryEmbedding(config), positions, q, k))


@pytest.mark.parametrize(
    "rope_parameters",
    [{"rope_type": "default"}, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}],
)
def test_partial_rotary_factor_matches_persimmon(rope_parameters):
    config = PersimmonConfig(
        hidden_size=H * D, num_attention_heads=H, partial_rotary_factor=0.5, max_position_embeddings=4096,
        rope_parameters={**rope_parameters, "rope_theta": 25000.0},
    )  # fmt: skip
    positions = torch.tensor(POSITIONS)
    q, k = torch.randn(len(positions), H, D), torch.randn(len(positions), H, D)
    rope = get_rope(config, D)
    assert rope.rotary_dim == D // 2
    ours = rope(positions, q, k)
    assert_same(ours, hf_rotate(PersimmonRotaryEmbedding(config), positions, q, k, rotary_dim=D // 2))
    torch.testing.assert_close(ours[0][..., D // 2 :], q[..., D // 2 :], atol=0, rtol=0)  # the tail passes through


def test_per_layer_type_rope_parameters_of_gemma3():
    config = Gemma3TextConfig(
        hidden_size=128, num_attention_heads=H, num_key_value_heads=HKV, head_dim=D, num_hidden_layers=6,
        max_position_embeddings=32768,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    )  # fmt: skip
    hf = Gemma3RotaryEmbedding(config)
    positions = torch.tensor(POSITIONS[:10])
    q, k = qk(len(positions))
    results = {}
    for layer_type in ("sliding_attention", "full_attention"):
        results[layer_type] = get_rope(config, D, layer_type=layer_type)(positions, q, k)
        assert_same(results[layer_type], hf_rotate(hf, positions, q, k, layer_type=layer_type))
    assert not torch.allclose(results["sliding_attention"][0], results["full_attention"][0])
    with pytest.raises(ValueError, match="per layer type.*pass layer_type"):
        get_rope(config, D)


@pytest.mark.filterwarnings("ignore")
def test_transformers_4_style_config_dict_with_rope_scaling():
    """A config.json written by transformers 4.x: rope_scaling with "type", rope_theta beside it."""
    legacy = {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
              "rope_theta": 1e6, "hidden_size": H * D, "num_attention_heads": H, "num_key_value_heads": HKV,
              "max_position_embeddings": 8192}  # fmt: skip
    config = LlamaConfig.from_dict(legacy)
    positions = torch.tensor(POSITIONS)
    q, k = qk(len(positions))
    assert_same(get_rope(config, D)(positions, q, k), hf_rotate(LlamaRotaryEmbedding(config), positions, q, k))


@pytest.mark.parametrize(
    "rope_scaling, rope_parameters",
    [
        (None, {"rope_type": "default"}),
        ({"type": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
        ({"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}),
    ],
)
def test_a_config_object_without_rope_parameters_uses_rope_scaling_and_rope_theta(rope_scaling, rope_parameters):
    """Older-style config objects (no rope_parameters at all): rope_scaling + rope_theta +
    partial_rotary_factor as attributes. Positions stay under the original context (dynamic = HF)."""
    old = SimpleNamespace(rope_scaling=rope_scaling, rope_theta=30000.0, partial_rotary_factor=0.5,
                          max_position_embeddings=4096, hidden_size=H * D, num_attention_heads=H)  # fmt: skip
    hf_config = PersimmonConfig(
        hidden_size=H * D, num_attention_heads=H, max_position_embeddings=4096, partial_rotary_factor=0.5,
        rope_parameters={**rope_parameters, "rope_theta": 30000.0},
    )  # fmt: skip
    positions = torch.tensor([0, 1, 5, 300, 2000, 4095])
    q, k = torch.randn(6, H, D), torch.randn(6, H, D)
    ours = get_rope(old, D)(positions, q, k)
    assert_same(ours, hf_rotate(PersimmonRotaryEmbedding(hf_config), positions, q, k, rotary_dim=D // 2))


def test_dynamic_equals_hf_for_a_prompt_within_the_original_context():
    config = llama_config({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}, max_position_embeddings=2048)
    positions = torch.arange(2048)
    q, k = qk(len(positions))
    assert_same(get_rope(config, D)(positions, q, k), hf_rotate(LlamaRotaryEmbedding(config), positions, q, k))


def test_dynamic_decode_queries_equal_hf_decoding_past_the_original_context():
    """HF grows its table to seq_len = p + 1 as decoding passes the original context."""
    config = llama_config({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}, max_position_embeddings=512)
    hf, rope = LlamaRotaryEmbedding(config), get_rope(config, D)
    for p in [510, 511, 512, 513, 700, 2000, 9000, *range(20000, 20300)]:
        q, k = qk(1, seed=p)
        assert_same(rope(torch.tensor([p]), q, k), hf_rotate(hf, torch.tensor([p]), q, k))


def test_dynamic_rule_is_per_token_whatever_the_batching():
    """Position p is rotated with HF's frequencies for seq_len = max(p + 1, max_position_embeddings),
    computed here by transformers' own dynamic-NTK initialiser (given seq_len as a tensor, as HF's
    forward does), in any batch or chunk."""
    config = llama_config({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, max_position_embeddings=1024)
    rope = get_rope(config, D)
    positions = torch.tensor([5, 1500, 1023, 1024, 40000, 1500, 3])
    q, k = qk(len(positions))
    batched = rope(positions, q, k)
    for i, p in enumerate(positions.tolist()):
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, None, seq_len=torch.tensor(p + 1))
        angle = float(p) * inv_freq  # [D / 2]: pair (j, j + D / 2) turns by angle[j]
        x1, x2 = q[i, :, : D // 2], q[i, :, D // 2 :]
        expected_q = torch.cat((x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()), -1)
        torch.testing.assert_close(batched[0][i], expected_q, atol=1e-5, rtol=0)
        alone = rope(positions[i : i + 1].clone(), q[i : i + 1], k[i : i + 1])  # a chunk of its own
        torch.testing.assert_close(alone[0], batched[0][i : i + 1], atol=0, rtol=0)
        torch.testing.assert_close(alone[1], batched[1][i : i + 1], atol=0, rtol=0)


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32,
            "original_max_position_embeddings": 1024}  # fmt: skip


@pytest.mark.parametrize(
    "rope_parameters, rope_type",
    [
        (LONGROPE, "longrope"),
        ({"rope_type": "made_up_rope"}, "made_up_rope"),
    ],
)
def test_unsupported_rope_types_are_refused_naming_type_key_and_supported(rope_parameters, rope_type):
    config = llama_config(dict(rope_parameters, rope_theta=10000.0))
    with pytest.raises(ValueError) as error:
        get_rope(config, D)
    message = str(error.value)
    assert repr(rope_type) in message and "rope_parameters" in message and "llama" in message
    assert "default, linear, dynamic, yarn, llama3, proportional" in message


def test_a_nested_unsupported_type_names_its_layer_type_key():
    config = Gemma3TextConfig(
        hidden_size=128, num_attention_heads=H, head_dim=D, num_hidden_layers=6,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "made_up_rope", "rope_theta": 1e6}},
    )  # fmt: skip
    get_rope(config, D, layer_type="sliding_attention")
    with pytest.raises(ValueError, match=r"'made_up_rope'.*rope_parameters\['full_attention'\]"):
        get_rope(config, D, layer_type="full_attention")


def test_a_missing_required_key_is_named():
    config = SimpleNamespace(rope_scaling={"type": "linear"}, rope_theta=1e4, max_position_embeddings=64)
    with pytest.raises(ValueError, match="'linear' needs 'factor'.*rope_scaling"):
        get_rope(config, D)


def test_the_compat_constructor_refuses_m_rope_configs():
    """A plain text model's RotaryEmbedding(config, head_dim) must never run 3-axis positions as 1-D,
    whether the config spells mrope_section out or leaves it to HF's Qwen2-VL default."""
    config = Qwen2VLConfig(rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}, hidden_size=32,
                           num_attention_heads=4)  # fmt: skip
    with pytest.raises(ValueError, match=r"M-RoPE \(mrope_section \[2, 1, 1\]\)"):
        RotaryEmbedding(config.get_text_config(), head_dim=8)
    with pytest.raises(ValueError, match=r"M-RoPE \(mrope_section \[16, 24, 24\]\)"):
        RotaryEmbedding(Qwen2VLConfig().get_text_config(), head_dim=128)
    assert RotaryEmbedding(llama_config(None), D).rope_type == "default"


def test_built_on_the_meta_device_it_runs_on_the_cpu():
    """Models are constructed under `with torch.device("meta")`; the tables stay real."""
    config = llama_config({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, 16384)
    with torch.device("meta"):
        rope = get_rope(config, D)
    positions = torch.tensor(POSITIONS)
    q, k = qk(len(positions))
    assert_same(rope(positions, q, k), get_rope(config, D)(positions, q, k))


def test_cos_sin_are_computed_once_per_positions_tensor():
    rope = get_rope(llama_config(None), D)
    calls = []
    angles = rope.angles
    rope.angles = lambda positions: calls.append(positions) or angles(positions)
    positions = torch.tensor([3, 4, 5])
    q, k = qk(3)
    first = rope(positions, q, k)
    for _ in range(3):  # every layer of a step
        assert_same(rope(positions, q, k), first)
    assert len(calls) == 1
    rope(torch.tensor([3, 4, 5]), q, k)  # the next step's tensor
    rope(positions, q.double(), k.double())  # another dtype
    assert len(calls) == 3


def test_position_zero_is_identity_and_norms_are_kept():
    rope = get_rope(llama_config(None), D)
    q, k = qk(3)
    torch.testing.assert_close(rope(torch.zeros(3, dtype=torch.long), q, k)[0], q)
    rotated = rope(torch.tensor([1, 7, 300]), q, k)[0]
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))
    assert not torch.allclose(rotated, q)


def test_scores_depend_only_on_the_distance():
    rope = get_rope(llama_config({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}), D)
    q, k = torch.randn(1, 1, D), torch.randn(1, 1, D)

    def score(m, n):
        return (rope(torch.tensor([m]), q, k)[0] * rope(torch.tensor([n]), q, k)[1]).sum()

    torch.testing.assert_close(score(5, 2), score(103, 100), atol=1e-4, rtol=0)
    assert not torch.isclose(score(5, 2), score(5, 4))
