"""The demo VLM's synthetic questions about a scene of ``tools/demo_vlm_data.py``: the base kinds, and the ways
of referring to and naming objects that every kind uses.

Question kinds (``BASE_KINDS``), every answer a short lowercase string without final punctuation:

* ``colour``   "What colour is the star?"                       -> "red"
* ``shape``    "What shape is the small blue object?"           -> "square"
* ``count``    "How many red shapes are there?"                 -> "two"     (number words, "zero" to "five";
  about ``ZERO_SHARE`` of the count questions ask about a colour or shape that is absent; colours, shapes, sizes
  and colour-shape pairs: "How many red circles are there?")
* ``position`` "Where is the green circle?"                     -> "left"    (left/right/top/bottom/middle)
* ``relation`` "Is the red circle to the left of the star?"     -> "yes"/"no" (balanced within every scene), or
  "Which shape is above the green triangle?"                    -> "the red circle"
* ``reading``  "What word is written in the image?"             -> "cat"; "What number is shown?" -> "42"
* ``describe`` "Describe the image."  -> "a large red circle, the word cat and a small blue star" (left to right)

and the kinds people asked when they tried the demo (``tools/demo_vlm_user_kinds.USER_KINDS``: existence, the
colour that is absent, the middle, colour synonyms, two or three questions at once, greetings, and pictures that
are not shapes scenes at all).

Objects are referred to only by a description that matches exactly one shape of the scene: its shape, colour,
size, or a combination ("the circle", "the red object", "the small star", "the large red circle"); a colour
question never names the colour and a shape question never names the shape. Answers that name an object use
"the {colour} {shape}", with the size in front ("the small red circle") only where colour and shape alone are
not unique. Position is asked only where it is clear-cut (``demo_vlm_data.position_clear``); relations as
``demo_vlm_data.relation`` says; "Which shape is above B?" only when exactly one object is "yes" and every other
object (the text included) is "no". The caption is given only when all horizontal distances between object
centres are at least ``ORDER_MARGIN``.

Phrasings: ``tools/demo_vlm_phrasings`` holds them, some held out for the ``"eval"`` split; layouts are held out
too (``demo_vlm_data.layout_split``).

``base_questions(scene, rng, split="train") -> [(kind, question, answer), ...]``: every question of the base
kinds the scene allows (relation yes/no subsampled to balance), one phrasing each, drawn from the split's
templates; ``tools/demo_vlm_datasets.questions`` adds the user kinds.
"""

from __future__ import annotations

import random
from collections import Counter

from tools.demo_vlm_data import (
    COLOURS,
    NUMBER_WORDS,
    ORDER_MARGIN,
    RELATIONS,
    SHAPES,
    SIZES,
    ZERO_SHARE,
    left_to_right,
    position_clear,
    position_of,
    relation,
)
from tools.demo_vlm_phrasings import split_templates

BASE_KINDS = ("colour", "shape", "count", "position", "relation", "reading", "describe")


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _matches(o: dict, attrs: dict) -> bool:
    return all(o.get(k) == v for k, v in attrs.items())


def _phrase(attrs: dict) -> str:
    words = [attrs[k] for k in ("size", "colour") if k in attrs]
    return "the " + " ".join(words + [attrs.get("shape", "object")])


def references(shape: dict, shapes: list[dict], without: str | None = None) -> list[str]:
    """Every description ("the red circle", "the small object", ...) that picks out exactly this shape;
    ``without`` ("colour" or "shape") leaves that attribute out of the descriptions."""
    combos = [("shape",), ("colour",), ("size", "shape"), ("colour", "shape"), ("size", "colour"),
              ("size", "colour", "shape")]  # fmt: skip
    refs = []
    for combo in combos:
        if without in combo:
            continue
        attrs = {k: shape[k] for k in combo}
        if sum(_matches(o, attrs) for o in shapes) == 1:
            refs.append(_phrase(attrs))
    return refs


def answer_name(shape: dict, shapes: list[dict]) -> str | None:
    """The canonical answer naming a shape: 'the red circle', or 'the small red circle' if that is needed."""
    for combo in (("colour", "shape"), ("size", "colour", "shape")):
        attrs = {k: shape[k] for k in combo}
        if sum(_matches(o, attrs) for o in shapes) == 1:
            return _phrase(attrs)
    return None


def describe(objects: list[dict]) -> str:
    """'a large red circle, the word cat and a small blue star': the objects from left to right."""
    parts = []
    for o in (objects[i] for i in left_to_right(objects)):
        if "text" in o:
            parts.append(f"the {o['text_kind']} {o['text']}")
        else:
            parts.append(f"{article(o['size'])} {o['size']} {o['colour']} {o['shape']}")
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def fill_template(template: str, **values: str) -> str:
    if "{Obj}" in template:
        values["Obj"] = values["obj"][0].upper() + values["obj"][1:]
    return template.format(**values)


def base_questions(scene: dict, rng: random.Random, split: str = "train") -> list[tuple[str, str, str]]:
    """Every (kind, question, answer) of the ``BASE_KINDS`` the scene allows, one phrasing each from the split's
    templates."""
    objects = scene["objects"]
    shapes = [o for o in objects if "text" not in o]
    texts = [o for o in objects if "text" in o]
    tpl = {kind: split_templates(kind, split) for kind in BASE_KINDS}
    out: list[tuple[str, str, str]] = []

    def ask(kind: str, answer: str, templates: list[str] | None = None, **values: str) -> None:
        out.append((kind, fill_template(rng.choice(templates or tpl[kind]), **values), answer))

    for s in shapes:
        if refs := references(s, shapes, without="colour"):
            ask("colour", s["colour"], obj=rng.choice(refs))
    for s in shapes:
        if refs := references(s, shapes, without="shape"):
            ask("shape", s["shape"], obj=rng.choice(refs))

    # count: all shapes, per colour / shape / size / colour and shape present, plus a few absent colours and
    # shapes ("zero")
    groups = [("shapes", len(shapes))]
    for attr, names, noun in (("colour", COLOURS, "{} shapes"), ("shape", SHAPES, "{}s"), ("size", SIZES, "{} shapes")):
        present = Counter(s[attr] for s in shapes)
        groups += [(noun.format(name), present[name]) for name in names if present[name]]
    pairs = Counter((s["colour"], s["shape"]) for s in shapes)
    groups += [(f"{colour} {shape}s", n) for (colour, shape), n in sorted(pairs.items())]
    absent = [f"{c} shapes" for c in COLOURS if not any(s["colour"] == c for s in shapes)]
    absent += [f"{k}s" for k in SHAPES if not any(s["shape"] == k for s in shapes)]
    n_zero = min(len(absent), int(len(groups) * ZERO_SHARE / (1 - ZERO_SHARE) + rng.random()))
    groups += [(things, 0) for things in rng.sample(absent, n_zero)]
    for things, count in groups:
        ask("count", NUMBER_WORDS[count], things=things)

    for s in shapes:
        if position_clear(s["cx"], s["cy"]) and (refs := references(s, shapes)):
            ask("position", position_of(s["cx"], s["cy"]), obj=rng.choice(refs))

    yes_no = [t for t in tpl["relation"] if "{a}" in t]
    which = [t for t in tpl["relation"] if "{a}" not in t]
    answers: dict[str, list[tuple[str, str, str]]] = {"yes": [], "no": []}
    for b in shapes:
        b_refs = references(b, shapes)
        if not b_refs:
            continue
        for rel, rel_words in RELATIONS.items():
            for a in shapes:
                a_refs = references(a, shapes)
                if a is not b and a_refs and (ans := relation(a, b, rel)) is not None:
                    answers[ans].append((rng.choice(a_refs), rel_words, rng.choice(b_refs)))
            others = [(a, relation(a, b, rel)) for a in objects if a is not b]
            hits = [a for a, ans in others if ans == "yes"]
            if len(hits) == 1 and "shape" in hits[0] and all(ans in ("yes", "no") for _, ans in others):
                if (name := answer_name(hits[0], shapes)) is not None:
                    ask("relation", name, which, rel=rel_words, b=rng.choice(b_refs))
    keep = min(len(answers["yes"]), len(answers["no"]))
    for ans in ("yes", "no"):
        for a_ref, rel_words, b_ref in rng.sample(answers[ans], keep):
            ask("relation", ans, yes_no, a=a_ref, rel=rel_words, b=b_ref)

    for t in texts:
        ask("reading", t["text"], thing=t["text_kind"])

    xs = sorted(o["cx"] for o in objects)
    if all(x2 - x1 >= ORDER_MARGIN for x1, x2 in zip(xs, xs[1:])):
        ask("describe", describe(objects))
    return out
