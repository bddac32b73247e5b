"""Prompt-order helpers: items of several modalities sorted by where they sit in the prompt."""

from __future__ import annotations

from tessera.multimodal.inputs import PlaceholderRange
from tessera.multimodal.utils import argsort_mm_positions, group_by_modality


def test_items_of_several_modalities_come_out_in_prompt_order():
    positions = {
        "image": [PlaceholderRange(offset=3, length=4), PlaceholderRange(offset=40, length=4)],
        "video": [PlaceholderRange(offset=10, length=20)],
        "audio": [PlaceholderRange(offset=0, length=2)],
    }
    order = argsort_mm_positions(positions)
    assert order == [("audio", 0), ("image", 0), ("video", 0), ("image", 1)]
    offsets = [positions[m][i].offset for m, i in order]
    assert offsets == sorted(offsets)


def test_no_items_no_order():
    assert argsort_mm_positions({}) == [] and argsort_mm_positions({"image": []}) == []


def test_runs_of_one_modality_are_grouped_without_reordering():
    items = ["image:a", "image:b", "video:c", "image:d", "video:e", "video:f"]
    groups = group_by_modality(items, lambda item: item.split(":")[0])
    assert groups == [("image", ["image:a", "image:b"]), ("video", ["video:c"]), ("image", ["image:d"]),
                      ("video", ["video:e", "video:f"])]  # fmt: skip
    assert [item for _, run in groups for item in run] == items
