"""tools/demo_vlm_pictures.py: pictures with no shapes, as scenes with no objects."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tools import demo_vlm_data as d
from tools import demo_vlm_slots as slots
from tools.demo_vlm_pictures import FAMILIES, make_picture, picture_split
from tools.demo_vlm_targets import patch_targets


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_draws_a_deterministic_picture_with_no_objects(family):
    rng = random.Random(1)
    images = []
    for _ in range(3):
        picture = make_picture(rng, "train", family)
        assert picture["objects"] == [] and picture_split(picture["picture"]["seed"]) == "train"
        image = d.render(picture)
        assert image.size == (d.IMAGE_SIZE, d.IMAGE_SIZE) and image.mode == "RGB"
        assert np.array_equal(np.asarray(image), np.asarray(d.render(picture)))
        images.append(np.asarray(image, dtype=np.float32))
        # nothing to write or to point at: every slot a filler, every patch "no object"
        assert set(slots.slot_words(picture)) == {slots.FILLER}
        assert not patch_targets(picture).any()
    assert not np.array_equal(images[0], images[1])  # a new seed, a new picture


def test_line_drawings_are_thin_strokes():
    rng = random.Random(2)
    for _ in range(10):
        grey = np.asarray(d.render(make_picture(rng, "train", "strokes")).convert("L"), dtype=np.float32)
        ink = np.abs(grey - np.median(grey)) > 40
        assert 0 < ink.mean() < 0.2  # lines, not filled regions


def test_about_a_tenth_of_the_pictures_are_held_out():
    held = sum(picture_split(seed) == "eval" for seed in range(2000))
    assert 100 < held < 300
    assert d.layout_split(make_picture(random.Random(3), "eval")) == "eval"
