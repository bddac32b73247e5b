"""The question kinds people asked when they tried the demo VLM on their own pictures (``USER_KINDS``), beside the
base kinds of ``tools/demo_vlm_questions``:

* ``existence``  "Is there a blue square?" / "Are there any stars?"                     -> "yes" / "no" (balanced;
  the "no"s mostly pair a colour and a shape that are both in the scene, but not together)
* ``absent``     "Which of these colours is not in the image: red, blue or green?"      -> "green"
* ``middle``     "What colour is the shape in the middle?" -> "purple"; "What shape is in the centre?" -> "square";
  "What is in the middle?" -> "the purple square"; "Where is the purple square?" -> "middle" (only where one
  shape is clearly in the middle and every other object clearly not)
* ``synonym``    a colour named by a synonym ("gray", "violet", "scarlet", "crimson") or spelt "color":
  "Is there a gray circle?" -> "yes"; "How many violet shapes are there?" -> "two"
* ``compound``   two or three questions in one message, answered in order in one reply, joined by "; ":
  "How many shapes are there, and what colour is the circle?" -> "three; red"
  (training adds one more, ``mixed_compound``: one or two yes/no parts beside a count, shape or name part)
* ``greeting``   "Hello!" with an image                                                  -> ``GREETING``
* ``no shapes``  any question about a picture that is not a shapes scene                -> ``NO_SHAPES``

``user_questions(scene, base, split)`` draws them from a generator seeded by the scene, not from the stream that
draws the scenes, so adding them leaves every scene and base question of a seed as it was.
"""

from __future__ import annotations

import random
from collections import Counter

from tools.demo_vlm_data import COLOURS, NUMBER_WORDS, SHAPES, SIZES, position_of
from tools.demo_vlm_phrasings import TEMPLATES, split_templates
from tools.demo_vlm_questions import answer_name, article, fill_template, references

USER_KINDS = ("existence", "absent", "middle", "synonym", "compound", "greeting", "no shapes")
GREETING = "Hello! Ask me about the shapes in this image: their colours, places, or a word written in it."
NO_SHAPES = "I see no simple shapes that I can describe in this image."
SYNONYMS = {"grey": ("gray",), "purple": ("violet",), "red": ("scarlet", "crimson")}
COMPOUND_KINDS = ("colour", "shape", "count", "position", "relation", "reading", "existence", "middle")
NOT_MIDDLE = 0.16  # every other object's centre at least this far from the image centre: "the middle" is one shape


def _thing(attrs: dict, plural: bool) -> str:
    """'a red circle' / 'red circles', 'a star' / 'stars', 'a red shape' / 'red shapes'."""
    words = [attrs[k] for k in ("size", "colour") if k in attrs] + [attrs.get("shape", "shape")]
    phrase = " ".join(words)
    return phrase + "s" if plural else f"{article(phrase)} {phrase}"


def existence(shapes: list[dict], rng: random.Random, tpl: dict, names: dict | None = None) -> list[tuple[str, str]]:
    """Balanced yes/no (question, answer)s about things present and absent; `names` renames the colours asked."""
    present = {(s["colour"], s["shape"]) for s in shapes}
    yes = [{"colour": c, "shape": k} for c, k in sorted(present)]
    yes += [{"shape": k} for k in sorted({s["shape"] for s in shapes})]
    yes += [{"colour": c} for c in sorted({s["colour"] for s in shapes})]
    yes += [{"size": z, "shape": k} for z, k in sorted({(s["size"], s["shape"]) for s in shapes})]
    colours_in, shapes_in = {s["colour"] for s in shapes}, {s["shape"] for s in shapes}
    hard = [{"colour": c, "shape": k} for c in sorted(colours_in) for k in sorted(shapes_in) if (c, k) not in present]
    easy = [{"colour": c, "shape": k} for c in COLOURS for k in SHAPES if c not in colours_in or k not in shapes_in]
    easy += [{"shape": k} for k in SHAPES if k not in shapes_in]
    easy += [{"colour": c} for c in COLOURS if c not in colours_in]
    no = hard + rng.sample(easy, min(len(easy), max(1, len(hard))))
    keep = min(len(yes), len(no), 3)
    out = []
    for answer, pool in (("yes", yes), ("no", no)):
        for attrs in rng.sample(pool, keep):
            if "colour" in attrs:
                attrs = attrs | {"colour": (names or {}).get(attrs["colour"], attrs["colour"])}
            template = rng.choice(tpl["existence"])
            out.append((template.format(a_thing=_thing(attrs, False), things=_thing(attrs, True)), answer))
    return out


def absent(shapes: list[dict], rng: random.Random, tpl: dict) -> list[tuple[str, str]]:
    """'Which of red, blue or green is not in the image?' with exactly one of the options absent."""
    present = sorted({s["colour"] for s in shapes})
    missing = [c for c in COLOURS if c not in present]
    if not present or not missing:
        return []
    options = rng.sample(present, min(2, len(present))) + [answer := rng.choice(missing)]
    rng.shuffle(options)
    listed = options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]
    return [(rng.choice(tpl["absent"]).format(options=listed), answer)]


def middle(objects: list[dict], shapes: list[dict], rng: random.Random, tpl: dict) -> list[tuple[str, str]]:
    """Questions about the one shape clearly in the middle (none where that is not clear-cut)."""

    def offset(o: dict) -> float:
        return max(abs(o["cx"] - 0.5), abs(o["cy"] - 0.5))

    centred = [o for o in objects if offset(o) < NOT_MIDDLE]
    if len(centred) != 1 or "shape" not in (s := centred[0]) or position_of(s["cx"], s["cy"]) != "middle":
        return []
    ref = rng.choice(tpl["middle_ref"])
    out = [(fill_template(rng.choice(tpl["middle_colour"]), mid=ref), s["colour"]),
           (fill_template(rng.choice(tpl["middle_shape"]), mid=ref), s["shape"])]  # fmt: skip
    if (name := answer_name(s, shapes)) is not None:
        out.append((rng.choice(tpl["middle_name"]), name))
    if refs := references(s, shapes):
        out.append((fill_template(rng.choice(tpl["position"]), obj=rng.choice(refs)), "middle"))
    return out


def synonym(shapes: list[dict], base: list, rng: random.Random, tpl: dict) -> list[tuple[str, str]]:
    """Questions naming a colour by a synonym, or spelling "colour" as "color"."""
    renamed = {c: rng.choice(SYNONYMS.get(c, (c,))) for c in COLOURS}
    out = [qa for qa in existence(shapes, rng, tpl, renamed) if any(w in qa[0] for n in SYNONYMS.values() for w in n)]
    counts = Counter(s["colour"] for s in shapes)
    for colour in SYNONYMS:
        if colour in counts or rng.random() < 0.3:
            things = f"{renamed[colour]} shapes"
            out.append((rng.choice(tpl["count"]).format(things=things), NUMBER_WORDS[counts[colour]]))
    for s in shapes:
        refs = [r for r in references(s, shapes, without="shape") if s["colour"] in r and s["colour"] in SYNONYMS]
        if refs:
            ref = rng.choice(refs).replace(s["colour"], renamed[s["colour"]])
            out.append((fill_template(rng.choice(tpl["shape"]), obj=ref), s["shape"]))
    out += [(q.replace("colour", "color"), a) for kind, q, a in base if kind == "colour" and "colour" in q]
    return rng.sample(out, min(3, len(out)))


def _joined(picked: list[tuple[str, str]], rng: random.Random, tpl: dict) -> tuple[str, str]:
    """(question without "?", answer)s joined by one of the split's templates into one message and one reply."""
    template = rng.choice(tpl[f"compound_{len(picked)}"])
    parts = {}
    for i, (question, _) in enumerate(picked):  # a question after another's "? " keeps its capital
        key = f"q{i + 1}"
        parts[key] = question if i == 0 or f"? {{{key}}}" in template else question[0].lower() + question[1:]
    return template.format(**parts), "; ".join(a for _, a in picked)


def compound(asked: list[tuple[str, str, str]], rng: random.Random, tpl: dict) -> list[tuple[str, str]]:
    """Two or three of the scene's questions (of different kinds, each one a question) in one message."""
    by_kind: dict[str, list] = {}
    for kind, question, answer in asked:
        if kind in COMPOUND_KINDS and question.endswith("?"):
            by_kind.setdefault(kind, []).append((question[:-1], answer))
    if len(by_kind) < 2:
        return []
    out = []
    for n in (2, 3) if len(by_kind) >= 3 else (2,):
        picked = [rng.choice(by_kind[kind]) for kind in rng.sample(sorted(by_kind), n)]
        out.append(_joined(picked, rng, tpl))
    return out


def mixed_compound(asked: list[tuple[str, str, str]], rng: random.Random, tpl: dict) -> list[tuple[str, str]]:
    """A compound (training only) that puts one or two yes/no parts beside a part answered with a number, a shape
    or a name, in a random order: the reader's compound misses answered such a count with "yes", a shape with the
    object's name, or flipped a relation's yes/no inside the list."""
    yes_no, other = [], []
    for kind, question, answer in asked:
        if kind in COMPOUND_KINDS and question.endswith("?"):
            (yes_no if answer in ("yes", "no") else other).append((question[:-1], answer))
    if not yes_no or not other:
        return []
    picked = rng.sample(yes_no, min(len(yes_no), rng.choice((1, 2)))) + [rng.choice(other)]
    rng.shuffle(picked)
    return [_joined(picked, rng, tpl)]


def no_shapes(rng: random.Random, tpl: dict) -> list[tuple[str, str]]:
    """Questions of every kind, about made-up shapes, for a picture with none."""
    colour, shape, other = rng.choice(tuple(COLOURS)), rng.choice(SHAPES), rng.choice(SHAPES)
    obj = rng.choice((f"the {shape}", f"the {colour} {shape}", f"the {rng.choice(tuple(SIZES))} {shape}"))
    things = rng.choice(("shapes", f"{colour} shapes", f"{shape}s"))
    fills = {
        **{"obj": obj, "Obj": obj[0].upper() + obj[1:], "things": things, "a": obj, "b": f"the {other}"},
        **{"rel": rng.choice(("above", "below", "to the left of")), "thing": rng.choice(("word", "number"))},
        **{"a_thing": _thing({"colour": colour, "shape": shape}, False), "mid": rng.choice(tpl["middle_ref"])},
    }
    kinds = ("colour", "shape", "count", "position", "relation", "reading", "describe", "describe", "existence",
             "middle_colour", "middle_name")  # fmt: skip
    return [(rng.choice(tpl[kind]).format(**fills), NO_SHAPES) for kind in rng.sample(kinds, 4)]


def user_questions(scene: dict, base: list[tuple[str, str, str]], split: str) -> list[tuple[str, str, str]]:
    """The ``USER_KINDS`` questions the scene allows (`base`: its base-kind questions), one phrasing each from the
    split's templates, drawn from a generator seeded by the scene."""
    rng = random.Random(f"{split}|{scene['noise_seed']}|{len(scene['objects'])}")
    tpl = {group: split_templates(group, split) for group in TEMPLATES}
    out = [("greeting", rng.choice(tpl["greeting"]), GREETING)]
    if "picture" in scene or not scene["objects"]:
        return out + [("no shapes", q, a) for q, a in no_shapes(rng, tpl)]
    objects = scene["objects"]
    shapes = [o for o in objects if "text" not in o]
    out += [("existence", q, a) for q, a in existence(shapes, rng, tpl)]
    out += [("absent", q, a) for q, a in absent(shapes, rng, tpl)]
    out += [("middle", q, a) for q, a in middle(objects, shapes, rng, tpl)]
    out += [("synonym", q, a) for q, a in synonym(shapes, base, rng, tpl)]
    out += [("compound", q, a) for q, a in compound(base + out, rng, tpl)]
    if split == "train":  # drawn last: the eval split's questions, and every earlier draw, stay as they were
        out += [("compound", q, a) for q, a in mixed_compound(base + out, rng, tpl)]
    return out
