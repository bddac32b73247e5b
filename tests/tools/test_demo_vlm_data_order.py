"""The order the demo VLM's slots list objects in: shapes drawn in one column (or row), as people draw them, get
one order whatever order they were drawn in, and every pair that a relation or a description asks about keeps
its order by position (expected values from the drawings' geometry)."""

from __future__ import annotations

import math
import random

import pytest

from tools import demo_vlm_data as data
from tools import demo_vlm_slots as slots
from tools import demo_vlm_targets as targets


def shape(name: str, colour: str, cx: float, cy: float) -> dict:
    return {"shape": name, "colour": colour, "size": "large", "cx": cx, "cy": cy, "extent": 0.13}


def scene(*objects: dict) -> dict:
    return {"objects": list(objects), "background": (245, 245, 245), "noise": 0.0, "noise_seed": 0}


def records(words: list[str]) -> list[list[str]]:
    used = [w for w in words if w != slots.FILLER]
    return [used[i : i + slots.RECORD] for i in range(0, len(used), slots.RECORD)]


def test_a_shape_exactly_above_another_is_listed_first_whichever_was_drawn_first():
    circle, square = shape("circle", "orange", 0.5, 0.27), shape("square", "blue", 0.5, 0.73)
    drawn_circle_first = slots.slot_words(scene(circle, square))
    drawn_square_first = slots.slot_words(scene(square, circle))
    assert drawn_circle_first == drawn_square_first
    first, second = records(drawn_circle_first)
    assert first == ["1", " large", " orange", " circle", " top", "1", ";"]
    assert second == ["2", " large", " blue", " square", " bottom", "2", ";"]


def test_shapes_side_by_side_in_one_row_rank_the_left_one_higher_whichever_was_drawn_first():
    corners = [shape("circle", "red", x, y) for x, y in ((0.25, 0.25), (0.75, 0.25), (0.25, 0.75), (0.75, 0.75))]
    middle = shape("square", "purple", 0.5, 0.5)
    for order in ([*corners, middle], [middle, *reversed(corners)]):
        recs = records(slots.slot_words(scene(*order)))
        # reading order: top-left, bottom-left, middle, top-right, bottom-right (on the diagonals: "top"/"bottom");
        # the row ranks count from the top left, along each row
        assert [r[4] for r in recs] == [" top", " bottom", " middle", " top", " bottom"]
        assert [r[5] for r in recs] == ["1", "4", "3", "2", "5"]
        t = targets.patch_targets(scene(*order)).reshape(len(targets.TARGETS), targets.GRID, targets.GRID)
        x_rank, y_rank = t[list(targets.TARGETS).index("x_rank")], t[list(targets.TARGETS).index("y_rank")]
        top_left, bottom_right = (2, 2), (6, 6)  # the patches under those centres
        assert (x_rank[top_left], y_rank[top_left]) == (1, 1) and (x_rank[bottom_right], y_rank[bottom_right]) == (5, 5)


def test_every_pair_a_question_can_ask_about_keeps_its_order_by_position():
    rng = random.Random(7)
    for _ in range(300):
        objects = data.make_scene(rng, "train")["objects"]
        column = {i: c for c, i in enumerate(data.left_to_right(objects))}
        row = {i: r for r, i in enumerate(data.top_to_bottom(objects))}
        for i, a in enumerate(objects):
            for j, b in enumerate(objects):
                if b["cx"] - a["cx"] >= min(data.RELATION_NO, data.ORDER_MARGIN):
                    assert column[i] < column[j]
                if b["cy"] - a["cy"] >= data.RELATION_NO:
                    assert row[i] < row[j]


@pytest.mark.parametrize("seed", range(3))
def test_align_pair_puts_two_objects_in_one_column_or_row_and_keeps_the_scene_valid(seed):
    rng = random.Random(seed)
    aligned_scenes = 0
    for _ in range(40):
        original = data.make_scene(rng, "train")
        aligned = data.align_pair(original, rng)
        before, after = original["objects"], aligned["objects"]
        moved = [k for k, (o, p) in enumerate(zip(before, after)) if o != p]
        assert len(after) == len(before) and len(moved) <= 1
        assert data.layout_split(aligned) == "train"
        if not moved:
            continue
        aligned_scenes += 1
        (k,) = moved
        changed = {key for key in before[k] if before[k][key] != after[k][key]}
        assert len(changed) == 1 and changed <= {"cx", "cy"}
        (axis,) = changed
        assert any(after[k][axis] == o[axis] for m, o in enumerate(after) if m != k)  # exactly in line
        for m, o in enumerate(after):  # still inside the picture and clear of every other object
            assert o["extent"] + data.BORDER - 1e-9 <= o["cx"] <= 1 - o["extent"] - data.BORDER + 1e-9
            assert o["extent"] + data.BORDER - 1e-9 <= o["cy"] <= 1 - o["extent"] - data.BORDER + 1e-9
            for p in after[m + 1 :]:
                assert math.hypot(o["cx"] - p["cx"], o["cy"] - p["cy"]) >= o["extent"] + p["extent"] + data.GAP - 1e-9
    assert aligned_scenes >= 10  # most scenes have room for it


def test_align_pair_leaves_a_single_object_alone():
    lone = scene(shape("star", "green", 0.4, 0.6))
    assert data.align_pair(lone, random.Random(0)) == lone


def test_the_aligned_eval_set_has_two_objects_in_line_in_most_scenes_and_asks_every_kind():
    from tools import demo_vlm_datasets as ds

    items = ds.make_eval_scenes(20, seed=5, aligned=True)
    scenes = list({id(scene): scene for scene, _, _, _ in items}.values())
    several = [s for s in scenes if len(s.get("objects", ())) >= 2]
    in_line = [s for s in several if any(a is not b and (a["cx"] == b["cx"] or a["cy"] == b["cy"])
                                         for a in s["objects"] for b in s["objects"])]  # fmt: skip
    assert len(in_line) >= 0.6 * len(several)
    assert all(data.layout_split(s) == "eval" for s in several)
    kinds = [kind for _, kind, _, _ in items]
    assert all(kinds.count(kind) >= 20 for kind in ds.KINDS)
