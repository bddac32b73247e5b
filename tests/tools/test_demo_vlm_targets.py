"""Per-patch targets from a scene's geometry: every object owns the patches it covers, at least the one of its
centre, and the classes there are the object's (expected values come from the scene, not from the code)."""

from __future__ import annotations

import random

import numpy as np
import torch

from tools import demo_vlm_data as data
from tools import demo_vlm_targets as targets


def targets_of(scene: dict) -> dict[str, torch.Tensor]:
    rows = targets.patch_targets(scene).reshape(len(targets.TARGETS), targets.GRID, targets.GRID)
    return dict(zip(targets.TARGETS, rows))


def cell(x: float, y: float) -> tuple[int, int]:
    """(row, col) of the patch holding a point."""
    return int(y * targets.GRID), int(x * targets.GRID)


def test_patch_targets_mark_the_patches_an_object_covers():
    star = {"shape": "star", "colour": "pink", "size": "large", "cx": 0.2, "cy": 0.7, "extent": 0.14}
    small = {"shape": "circle", "colour": "pink", "size": "small", "cx": 0.72, "cy": 0.66, "extent": 0.06}
    text = {"text": "cat", "text_kind": "word", "cx": 0.75, "cy": 0.25, "extent": 0.1, "half_w": 0.1, "half_h": 0.07,
            "font": 0.2}  # fmt: skip
    t = targets_of({"objects": [star, small, text]})
    at_star, at_small, at_word, empty = cell(0.2, 0.7), cell(0.72, 0.66), cell(0.75, 0.25), cell(0.95, 0.95)
    assert t["shape"][at_star] == data.SHAPES.index("star") + 1 and t["size"][at_star] == 2
    assert t["colour"][at_star] == list(data.COLOURS).index("pink") + 1
    assert t["position"][at_star] == data.POSITIONS.index("left") + 1
    assert (t["x"][at_star], t["y"][at_star]) == (at_star[1] + 1, at_star[0] + 1)
    assert t["same_colour"][at_star] == 2 and t["same_shape"][at_star] == 1 and t["same_size"][at_star] == 1
    # left to right: star (0.2), circle (0.72), word (0.75); top to bottom: word (0.25), circle (0.66), star
    assert (t["x_rank"][at_star], t["x_rank"][at_small], t["x_rank"][at_word]) == (1, 2, 3)
    assert (t["y_rank"][at_star], t["y_rank"][at_small], t["y_rank"][at_word]) == (3, 2, 1)
    assert t["shape"][at_small] == data.SHAPES.index("circle") + 1 and t["size"][at_small] == 1
    assert t["shape"][at_word] == len(data.SHAPES) + 1 and targets.TEXT_CLASSES[t["text"][at_word]] == "cat"
    word_row = [targets.CHARACTERS[c - 1] for c in t["char"][at_word[0]].tolist() if c]
    letters = "".join(dict.fromkeys(word_row))  # the word's patches read its letters left to right
    assert len(letters) >= 2 and letters in "cat" and t["char"][at_star] == 0
    assert t["anchor"].sum() == 3 and t["anchor"][at_star] == t["anchor"][at_small] == t["anchor"][at_word] == 1
    assert torch.all(t["shapes"] == 2)  # the word is not a shape
    assert [int(t[name][empty]) for name in targets.TARGETS if name != "shapes"] == [0] * (len(targets.TARGETS) - 1)
    assert int((t["shape"] == data.SHAPES.index("star") + 1).sum()) > 1  # a large shape covers several patches


def test_every_object_owns_at_least_the_patch_of_its_centre():
    rng = random.Random(0)
    for _ in range(200):
        scene = data.make_scene(rng)
        t = targets_of(scene)
        for obj in scene["objects"]:
            where = cell(obj["cx"], obj["cy"])
            expected = len(data.SHAPES) + 1 if "text" in obj else data.SHAPES.index(obj["shape"]) + 1
            assert t["anchor"][where] == 1 and t["shape"][where] == expected


def test_character_spans_cover_the_drawn_text_left_to_right():
    rng = random.Random(4)
    for _ in range(20):
        scene = data.make_scene(rng, text=True)
        (obj,) = [o for o in scene["objects"] if "text" in o]
        spans = targets.char_spans(obj)
        assert "".join(c for c, _, _ in spans) == obj["text"]
        assert all(a < b <= c for (_, a, b), (_, c, _) in zip(spans, spans[1:]))
        alone = dict(scene, objects=[obj], noise=0.0)
        ink = (np.asarray(data.render(alone), dtype=float).mean(-1) < np.mean(alone["background"]) - 40).any(0)
        columns = (np.flatnonzero(ink) + 0.5) / data.IMAGE_SIZE
        pixel = 1 / data.IMAGE_SIZE
        assert spans[0][1] - pixel <= columns.min() and columns.max() <= spans[-1][2] + pixel
        assert columns.min() < spans[0][2] and columns.max() > spans[-1][1]  # the first and last glyphs are inked
