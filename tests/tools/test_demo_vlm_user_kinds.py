"""tools/demo_vlm_user_kinds.py: the question kinds people asked about the demo, answered from the scene.

Expected answers are worked out here from hand-built scenes (or recounted from a random scene's objects), never
taken from the generator's own helpers.
"""

from __future__ import annotations

import random
import re
from collections import Counter

from tools import demo_vlm_data as d
from tools import demo_vlm_datasets as ds
from tools.demo_vlm_phrasings import HELD_OUT, TEMPLATES
from tools.demo_vlm_pictures import make_picture
from tools.demo_vlm_questions import base_questions
from tools.demo_vlm_user_kinds import GREETING, NO_SHAPES, SYNONYMS, USER_KINDS, user_questions


def _shape(name, colour, size, cx, cy):
    return {"shape": name, "colour": colour, "size": size, "cx": cx, "cy": cy,
            "extent": {"small": 0.07, "large": 0.13}[size], "rgb": d.COLOURS[colour]}  # fmt: skip


def _scene(objects, seed=0):
    return {"objects": objects, "background": (245, 245, 245), "noise": 0.0, "noise_seed": seed}


def _asked(scene, seeds=range(40), split="train"):
    """Every user-kind question of the scene over many seeds (the generator is seeded by the scene)."""
    out = set()
    for seed in seeds:
        scene = dict(scene, noise_seed=seed)
        out |= set(ds.questions(scene, random.Random(seed), split))
    return {qa for qa in out if qa[0] in USER_KINDS}


# four shapes in the corners, a purple square in the middle: the first scene
CORNERS = [
    _shape("circle", "red", "large", 0.2, 0.2), _shape("triangle", "green", "large", 0.8, 0.2),
    _shape("star", "blue", "large", 0.2, 0.8), _shape("diamond", "yellow", "large", 0.8, 0.8),
    _shape("square", "purple", "large", 0.5, 0.5),
]  # fmt: skip


def test_the_shape_in_the_middle():
    qas = _asked(_scene(CORNERS))
    middle = {(q, a) for k, q, a in qas if k == "middle"}
    refs = "|".join(re.escape(r) for r in TEMPLATES["middle_ref"])
    for question, answer in middle:
        if re.search("colou?r", question) and re.search(refs, question):
            assert answer == "purple", question
        elif re.search(refs, question):
            assert answer == "square", question
        elif question in TEMPLATES["middle_name"]:
            assert answer == "the purple square", question
        else:  # "Where is the purple square?", "What is the position of the purple object?"
            assert "purple" in question or "square" in question, question
            assert answer == "middle", question
    assert {a for _, a in middle} == {"purple", "square", "the purple square", "middle"}
    # nothing is asked about "the middle" when two shapes are near it
    crowded = CORNERS[:3] + [_shape("square", "purple", "small", 0.5, 0.5), _shape("circle", "red", "small", 0.63, 0.5)]
    assert not [k for k, _, _ in _asked(_scene(crowded)) if k == "middle"]


def test_existence_is_balanced_and_true():
    shapes = [_shape("circle", "orange", "large", 0.3, 0.25), _shape("square", "blue", "large", 0.3, 0.75)]
    qas = [(q, a) for k, q, a in _asked(_scene(shapes)) if k == "existence"]
    counts = Counter(a for _, a in qas)
    assert counts["yes"] > 5 and counts["no"] > 5
    present = {("orange", "circle"), ("blue", "square")}
    for question, answer in qas:
        colour = next((c for c in d.COLOURS if re.search(rf"\b{c}\b", question)), None)
        shape = next((s for s in d.SHAPES if re.search(rf"\b{s}s?\b", question)), None)
        size = next((z for z in d.SIZES if re.search(rf"\b{z}\b", question)), None)
        fits = [(c, s) for c, s in present if colour in (None, c) and shape in (None, s) and size in (None, "large")]
        assert answer == ("yes" if fits else "no"), question
    # the hard "no": both the colour and the shape are in the scene, not together
    assert any(a == "no" and "blue circle" in q for q, a in qas)


def test_the_absent_colour_is_the_one_option_not_drawn():
    shapes = [_shape("circle", "red", "large", 0.3, 0.3), _shape("star", "green", "small", 0.7, 0.7)]
    qas = [(q, a) for k, q, a in _asked(_scene(shapes)) if k == "absent"]
    assert qas
    for question, answer in qas:
        options = [c for c in d.COLOURS if re.search(rf"\b{c}\b", question)]
        assert answer in options and [c for c in options if c not in ("red", "green")] == [answer], question


def test_synonyms_name_the_same_colours():
    shapes = [_shape("circle", "grey", "large", 0.3, 0.3), _shape("star", "purple", "small", 0.7, 0.7),
              _shape("square", "purple", "large", 0.7, 0.25)]  # fmt: skip
    qas = [(q, a) for k, q, a in _asked(_scene(shapes)) if k == "synonym"]
    words = {w: c for c, names in SYNONYMS.items() for w in names}
    seen = set()
    for question, answer in qas:
        named = [w for w in words if re.search(rf"\b{w}\b", question)]
        assert named or "color" in question, question
        if "How many" in question or "Count" in question or "number of" in question:
            expected = {"grey": "one", "purple": "two", "red": "zero"}[words[named[0]]]
            assert answer == expected, question
        seen |= set(named)
    assert {"gray", "violet"} <= seen


def test_compound_answers_each_part_in_order():
    shapes = [_shape("circle", "red", "large", 0.2, 0.5), _shape("square", "blue", "large", 0.5, 0.2),
              _shape("triangle", "green", "large", 0.8, 0.5)]  # fmt: skip
    scene = _scene(shapes)
    checked = 0
    for seed in range(20):
        scene = dict(scene, noise_seed=seed)
        qas = ds.questions(scene, random.Random(seed), "train")
        singles = {q.rstrip("?"): a for k, q, a in qas if k not in ("compound", "greeting")}
        for kind, question, answer in qas:
            if kind != "compound":
                continue
            parts = answer.split("; ")
            assert 2 <= len(parts) <= 3
            text = question.lower()
            spans = sorted((text.find(q.lower()), len(q), a) for q, a in singles.items() if q.lower() in text)
            # the sub-questions: the longest match at each place, none inside another
            picked, end = [], -1
            for start, length, ans in sorted(spans, key=lambda m: (m[0], -m[1])):
                if start >= end:
                    picked.append(ans)
                    end = start + length
            assert picked == parts, (question, answer)
            checked += 1
    assert checked >= 20


def test_greetings_and_pictures_with_no_shapes():
    rng = random.Random(0)
    for _ in range(20):
        picture = make_picture(rng)
        qas = ds.questions(picture, rng, "train")
        assert {k for k, _, _ in qas} == {"greeting", "no shapes"}
        assert all(a == (GREETING if k == "greeting" else NO_SHAPES) for k, _, a in qas)
    qas = _asked(_scene(CORNERS))
    assert {a for k, _, a in qas if k == "greeting"} == {GREETING}
    assert "no simple shapes" in NO_SHAPES


def test_user_kinds_leave_the_scenes_and_base_questions_of_a_seed_alone():
    rng_a, rng_b = random.Random(5), random.Random(5)
    for _ in range(10):
        a, b = d.make_scene(rng_a), d.make_scene(rng_b)
        qa, qb = ds.questions(a, rng_a), base_questions(b, rng_b)
        assert qa[: len(qb)] == qb and a == b


def test_eval_split_uses_only_held_out_phrasings():
    for scene, kind, question, _ in ds.make_eval_scenes(4, seed=3):
        if kind == "existence":
            assert any(re.fullmatch(re.escape(t).replace(r"\{a_thing\}", ".+").replace(r"\{things\}", ".+"), question)
                       for t in HELD_OUT["existence"]), question  # fmt: skip
        elif kind == "greeting":
            assert question in HELD_OUT["greeting"]
    picked = [k for _, k, _, _ in ds.make_eval_scenes(4, seed=3)]
    assert all(picked.count(k) >= 4 for k in USER_KINDS)


def test_user_questions_of_an_empty_scene_say_there_are_no_shapes():
    qas = user_questions(_scene([]), [], "eval")
    assert {k for k, _, _ in qas} == {"greeting", "no shapes"}


def test_training_adds_a_compound_with_a_yes_no_beside_another_answer():
    shapes = [_shape("circle", "red", "large", 0.2, 0.5), _shape("square", "blue", "large", 0.5, 0.2),
              _shape("triangle", "green", "small", 0.8, 0.5)]  # fmt: skip
    for seed in range(20):
        scene = _scene(shapes, seed)
        compounds = {split: [a.split("; ") for k, _, a in ds.questions(scene, random.Random(seed), split)
                             if k == "compound"] for split in ("train", "eval")}  # fmt: skip
        assert len(compounds["train"]) == len(compounds["eval"]) + 1  # the eval split's questions stay as they were
        mixed = compounds["train"][-1]
        assert 2 <= len(mixed) <= 3
        assert 1 <= sum(p in ("yes", "no") for p in mixed) == len(mixed) - 1, mixed
