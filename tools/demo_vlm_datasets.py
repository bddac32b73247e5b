"""The demo VLM's datasets: scenes (``tools/demo_vlm_data``) or pictures with no shapes
(``tools/demo_vlm_pictures``) with every question of every kind (``KINDS``) they allow, for training and for the
held-out evaluation.

* ``questions(scene, rng, split="train") -> [(kind, question, answer), ...]``: the base kinds
  (``tools/demo_vlm_questions``) drawn from `rng`, then the user kinds (``tools/demo_vlm_user_kinds``) from a
  generator of their own, seeded by the scene, so that they leave `rng`'s stream as the base kinds left it. A
  picture with no shapes gets only the user kinds ("no shapes" answers and a greeting).
* ``make_dataset(n, seed, split="train") -> [(image, [(kind, question, answer), ...]), ...]``: n scenes.
* ``make_eval_set(n_per_kind, seed) -> [(image, kind, question, answer), ...]``: eval layouts, pictures and
  templates, at least ``n_per_kind`` questions of every kind, single-object scenes included
  (``make_eval_scenes``: the same with the scene instead of its image; ``aligned=True``: two objects of each
  scene in one column or row).
"""

from __future__ import annotations

import random
from collections import Counter

from PIL import Image

from tools.demo_vlm_data import align_pair, make_scene, render
from tools.demo_vlm_pictures import make_picture
from tools.demo_vlm_questions import BASE_KINDS, base_questions
from tools.demo_vlm_user_kinds import USER_KINDS, user_questions

KINDS = BASE_KINDS + USER_KINDS
PICTURE_EVAL_EVERY = 5  # every fifth eval scene is a picture with no shapes


def questions(scene: dict, rng: random.Random, split: str = "train") -> list[tuple[str, str, str]]:
    """Every (kind, question, answer) the scene (or picture) allows, one phrasing each from the split's
    templates."""
    base = [] if "picture" in scene else base_questions(scene, rng, split)
    return base + user_questions(scene, base, split)


def make_dataset(n: int, seed: int, split: str = "train") -> list[tuple[Image.Image, list[tuple[str, str, str]]]]:
    """n scenes of the split, each as (image, [(kind, question, answer), ...]); the same list for a seed."""
    rng = random.Random(seed)
    data = []
    for _ in range(n):
        scene = make_scene(rng, split)
        data.append((render(scene), questions(scene, rng, split)))
    return data


def make_eval_set(n_per_kind: int, seed: int) -> list[tuple[Image.Image, str, str, str]]:
    """``make_eval_scenes`` with each scene rendered: (image, kind, question, answer)."""
    return with_images(make_eval_scenes(n_per_kind, seed))


def with_images(items: list[tuple[dict, str, str, str]]) -> list[tuple[Image.Image, str, str, str]]:
    """(scene, kind, question, answer) items as (image, kind, question, answer), each scene rendered once."""
    images: dict[int, Image.Image] = {}
    return [(images.setdefault(id(scene), render(scene)), kind, question, answer)
            for scene, kind, question, answer in items]  # fmt: skip


def answer_class(kind: str, answer: str) -> str | None:
    """What the eval set balances within a kind: yes / no / which for relations, the answer where there are few."""
    if kind == "relation":
        return answer if answer in ("yes", "no") else "which"
    return answer if kind in ("count", "position", "existence") else None


def make_eval_scenes(n_per_kind: int, seed: int, aligned: bool = False) -> list[tuple[dict, str, str, str]]:
    """Eval layouts, pictures and held-out phrasings: at least n_per_kind (scene, kind, question, answer) of every
    kind, one question per kind per scene; every ``PICTURE_EVAL_EVERY``-th scene is a picture with no shapes, every
    fourth other scene has a single object, every third one a text. Among a scene's questions of a kind, the one
    whose ``answer_class`` is the rarest so far is taken, so that those answers come out balanced. `aligned`: every
    scene of two or more objects has two of them in one column or row (``align_pair``), as people draw them."""
    rng = random.Random(seed)
    counts = dict.fromkeys(KINDS, 0)
    seen: Counter = Counter()
    out = []
    i = 0
    while min(counts.values()) < n_per_kind:
        if i % PICTURE_EVAL_EVERY == PICTURE_EVAL_EVERY - 1:
            scene = make_picture(rng, "eval")
        else:
            n = 1 if i % 4 == 0 else None
            text = False if n == 1 else (True if i % 3 == 0 else None)
            scene = make_scene(rng, "eval", n=n, text=text)
            if aligned:
                scene = align_pair(scene, rng)
        i += 1
        qas = questions(scene, rng, "eval")
        for kind in KINDS:
            options = [qa for qa in qas if qa[0] == kind]
            if counts[kind] >= n_per_kind or not options:
                continue
            rarest = min(seen[kind, answer_class(kind, a)] for _, _, a in options)
            _, question, answer = rng.choice([qa for qa in options if seen[kind, answer_class(kind, qa[2])] == rarest])
            out.append((scene, kind, question, answer))
            counts[kind] += 1
            seen[kind, answer_class(kind, answer)] += 1
    return out
