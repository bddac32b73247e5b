"""M-RoPE prompt positions equal transformers' own `get_rope_index` of Qwen2-VL and Qwen2.5-VL."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

from tessera.models.mrope_positions import VisionGrid, decode_positions, mrope_input_positions

MERGE = 2
TEXT, IMAGE, VIDEO = 0, 1, 2


def hf_rope_index(hf_cls, layout, image_grids, video_grids, seconds_per_grid=None, tokens_per_second=2):
    """HF's positions and delta for a prompt laid out as [(kind, length)], through the unbound
    method on a stand-in model carrying only the config fields it reads."""
    types = torch.tensor([[kind for kind, length in layout for _ in range(length)]])
    vision_config = SimpleNamespace(spatial_merge_size=MERGE, tokens_per_second=tokens_per_second)
    model = SimpleNamespace(config=SimpleNamespace(vision_config=vision_config))
    model.get_vision_position_ids = lambda *a, **k: hf_cls.get_vision_position_ids(model, *a, **k)
    kwargs = dict(
        image_grid_thw=torch.tensor(image_grids) if image_grids else None,
        video_grid_thw=torch.tensor(video_grids) if video_grids else None,
    )
    if seconds_per_grid is not None:
        kwargs["second_per_grid_ts"] = torch.tensor(seconds_per_grid)
    positions, deltas = hf_cls.get_rope_index(model, torch.zeros_like(types), types, **kwargs)
    return positions[:, 0], int(deltas[0, 0])


def our_rope_index(layout, image_grids, video_grids, video_intervals=None):
    grids, offset = [], 0
    images, videos = iter(image_grids), iter(video_grids)
    intervals = iter(video_intervals or [1.0] * len(video_grids))
    for kind, length in layout:
        if kind == IMAGE:
            grids.append(VisionGrid(offset, tuple(next(images))))
        elif kind == VIDEO:
            grids.append(VisionGrid(offset, tuple(next(videos)), next(intervals)))
        offset += length
    return mrope_input_positions(offset, grids, MERGE)


def tokens(grid):
    t, h, w = grid
    return t * h * w // MERGE**2


IMAGES = [[1, 4, 6], [1, 8, 2], [1, 2, 2]]
CASES = {
    "one image": ([(TEXT, 3), (IMAGE, tokens(IMAGES[0])), (TEXT, 5)], IMAGES[:1], []),
    "image first": ([(IMAGE, tokens(IMAGES[1])), (TEXT, 4)], IMAGES[1:2], []),
    "three images": (
        [(TEXT, 2), (IMAGE, 6), (TEXT, 3), (IMAGE, 4), (TEXT, 1), (IMAGE, 1), (TEXT, 7)],
        IMAGES,
        [],
    ),
    "image and video": (
        [(TEXT, 2), (IMAGE, 6), (TEXT, 2), (VIDEO, tokens([3, 4, 4])), (TEXT, 3)],
        IMAGES[:1],
        [[3, 4, 4]],
    ),
    "ends with an image": ([(TEXT, 2), (IMAGE, 4)], IMAGES[1:2], []),
}


@pytest.mark.parametrize("hf_cls", [Qwen2VLModel, Qwen2_5_VLModel], ids=["qwen2-vl", "qwen2.5-vl"])
@pytest.mark.parametrize("case", CASES)
def test_prompt_positions_equal_hf_get_rope_index(hf_cls, case):
    layout, image_grids, video_grids = CASES[case]
    seconds = [1.0] * len(video_grids) if hf_cls is Qwen2_5_VLModel else None
    expected, expected_delta = hf_rope_index(hf_cls, layout, image_grids, video_grids, seconds)
    intervals = [2 * s for s in seconds] if seconds else None  # tokens_per_second * seconds per grid
    ours, delta = our_rope_index(layout, image_grids, video_grids, intervals)
    assert torch.equal(ours, expected)
    assert delta == expected_delta


def test_video_time_interval_spaces_frames_as_qwen2_5_vl():
    layout = [(TEXT, 1), (VIDEO, tokens([4, 2, 2])), (TEXT, 2)]
    expected, expected_delta = hf_rope_index(Qwen2_5_VLModel, layout, [], [[4, 2, 2]], [1.5], tokens_per_second=4)
    ours, delta = our_rope_index(layout, [], [[4, 2, 2]], [4 * 1.5])
    assert torch.equal(ours, expected) and delta == expected_delta
    assert ours[0, 1:5].tolist() == [1, 7, 13, 19]  # one frame per grid step of 6 positions, from 1


def test_text_only_is_1d_and_decode_continues_after_the_delta():
    positions, delta = mrope_input_positions(5, [], MERGE)
    assert torch.equal(positions, torch.arange(5).expand(3, -1)) and delta == 0
    layout, image_grids, _ = CASES["one image"]
    positions, delta = our_rope_index(layout, image_grids, [])
    prompt_len = positions.shape[1]
    # HF's decode: cache position + delta on every axis
    expected = (torch.arange(3) + prompt_len + delta).expand(3, -1)
    assert torch.equal(decode_positions(prompt_len, prompt_len + 3, delta), expected)
    assert decode_positions(prompt_len, prompt_len + 1, delta)[0, 0] == positions.max() + 1


def test_items_past_the_prompt_or_overlapping_are_refused():
    with pytest.raises(ValueError, match="past the prompt"):
        mrope_input_positions(4, [VisionGrid(2, (1, 4, 4))], MERGE)
    with pytest.raises(ValueError, match="overlaps"):
        mrope_input_positions(20, [VisionGrid(0, (1, 4, 4)), VisionGrid(2, (1, 2, 2))], MERGE)
