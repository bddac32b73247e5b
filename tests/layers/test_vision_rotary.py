"""The Qwen2-VL family's 2-D vision rope against transformers 5.x (get_vision_position_ids +
Qwen2VLVisionRotaryEmbedding + apply_rotary_pos_emb_vision), against transformers 4.x's
`rot_pos_emb` (written out below) and against the patch order it defines."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5_VLVisionConfig, Qwen2VLVisionConfig, Qwen3VLVisionConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLVisionRotaryEmbedding
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLVisionRotaryEmbedding
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision as hf_apply
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionRotaryEmbedding
from transformers.vision_utils import get_vision_position_ids

from tessera.layers.vision_rotary import VisionRotaryEmbedding, apply_rotary_pos_emb_vision, vision_position_ids

GRID = torch.tensor([[1, 4, 6], [2, 2, 4], [1, 8, 2]])  # an image, a 2-frame video, a tall image
N = int((GRID[:, 0] * GRID[:, 1] * GRID[:, 2]).sum())
HEADS = 3


def hf_4x_rot_pos_emb(grid_thw, head_dim, theta, spatial_merge_size):
    """transformers 4.x: VisionRotaryEmbedding(head_dim // 2) + Qwen2VisionTransformerPretrainedModel.rot_pos_emb."""
    dim = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    pos_ids = []
    for t, h, w in grid_thw:
        hpos_ids = torch.arange(h).unsqueeze(1).expand(-1, w)
        hpos_ids = hpos_ids.reshape(h // spatial_merge_size, spatial_merge_size, w // spatial_merge_size,
                                    spatial_merge_size).permute(0, 2, 1, 3).flatten()  # fmt: skip
        wpos_ids = torch.arange(w).unsqueeze(0).expand(h, -1)
        wpos_ids = wpos_ids.reshape(h // spatial_merge_size, spatial_merge_size, w // spatial_merge_size,
                                    spatial_merge_size).permute(0, 2, 1, 3).flatten()  # fmt: skip
        pos_ids.append(torch.stack([hpos_ids, wpos_ids], dim=-1).repeat(t, 1))
    pos_ids = torch.cat(pos_ids, dim=0)
    max_grid_size = grid_thw[:, 1:].max()
    seq = torch.arange(max_grid_size, dtype=inv_freq.dtype)
    rotary_pos_emb_full = torch.outer(seq, inv_freq)
    return rotary_pos_emb_full[pos_ids].flatten(1)


@pytest.mark.parametrize(
    "config, hf_cls",
    [
        (Qwen2VLVisionConfig(embed_dim=96, num_heads=HEADS, spatial_merge_size=2), Qwen2VLVisionRotaryEmbedding),
        (
            Qwen2_5_VLVisionConfig(hidden_size=48, num_heads=HEADS, spatial_merge_size=2),
            Qwen2_5_VLVisionRotaryEmbedding,
        ),
        (Qwen3VLVisionConfig(hidden_size=48, num_heads=HEADS, spatial_merge_size=2), Qwen3VLVisionRotaryEmbedding),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_hf(config, hf_cls, dtype):
    rope = VisionRotaryEmbedding.from_config(config)
    head_dim = rope.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(N, HEADS, head_dim, generator=g).to(dtype)
    k = torch.randn(N, HEADS, head_dim, generator=g).to(dtype)
    hf_cos, hf_sin = hf_cls(config)(q, get_vision_position_ids(GRID, config.spatial_merge_size))
    cos, sin = rope(GRID)
    assert cos.shape == (N, head_dim) and cos.dtype == torch.float32
    torch.testing.assert_close(cos, hf_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin, atol=1e-6, rtol=0)
    ours = apply_rotary_pos_emb_vision(q, k, cos, sin)
    for a, b in zip(ours, hf_apply(q, k, hf_cos, hf_sin)):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_angles_match_transformers_4_rot_pos_emb():
    rope = VisionRotaryEmbedding(head_dim=40, theta=10000.0, spatial_merge_size=2)
    expected = hf_4x_rot_pos_emb(GRID, 40, 10000.0, 2)
    torch.testing.assert_close(rope.rot_pos_emb(GRID), expected, atol=0, rtol=0)
    torch.testing.assert_close(rope.rot_pos_emb(GRID.tolist()), expected, atol=0, rtol=0)  # a plain list too


def test_patches_come_merge_block_by_merge_block():
    """A 4 x 6 grid, merge 2: the first 2 x 2 block, row-major, then the block to its right; the
    video's two frames repeat the same cells."""
    ids = vision_position_ids([[1, 4, 6], [2, 2, 4]], spatial_merge_size=2).tolist()
    assert ids[:8] == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    assert ids[12:16] == [[2, 0], [2, 1], [3, 0], [3, 1]]  # the second block row
    video = ids[24:]
    assert len(video) == 16 and video[:8] == video[8:]
    assert video[:8] == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]


def test_the_first_half_turns_with_the_row_and_the_second_with_the_column():
    rope = VisionRotaryEmbedding(head_dim=16, theta=100.0, spatial_merge_size=1)
    angles = rope.rot_pos_emb([[1, 3, 5]])  # merge 1: plain row-major
    inv_freq = 1.0 / 100.0 ** (torch.arange(0, 8, 2).float() / 8)
    row, col = 2, 4
    torch.testing.assert_close(angles[row * 5 + col], torch.cat((row * inv_freq, col * inv_freq)))


def test_grids_not_divisible_by_the_merge_size_are_refused():
    with pytest.raises(ValueError, match=r"grid \[1, 3, 4\].*spatial_merge_size 2"):
        VisionRotaryEmbedding(16).rot_pos_emb([[1, 3, 4]])


def test_built_on_the_meta_device_it_runs_on_the_cpu():
    with torch.device("meta"):
        rope = VisionRotaryEmbedding(32)
    torch.testing.assert_close(rope(GRID)[0], VisionRotaryEmbedding(32)(GRID)[0], atol=0, rtol=0)
