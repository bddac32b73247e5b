"""Richer synthetic visual question answering for the ViT + SmolLM2 demo VLM (seeded, deterministic).

A scene is one to five non-overlapping objects on a light background (plain or lightly noisy, one of a few
light tints), drawn ``SUPERSAMPLE`` times larger and downscaled (anti-aliased), ``IMAGE_SIZE`` x ``IMAGE_SIZE``
RGB. An object is a shape (``SHAPES``) in one of ``COLOURS``, ``small`` or ``large`` (a large shape's extent is
at least ``MIN_SIZE_RATIO`` times a small one's; in scenes of up to three objects, ``BIG_PROB`` of the large
shapes are big, up to ``BIG_EXTENT[n]``: people draw a lone shape big, often in the middle), or, in about
``TEXT_PROB`` of the scenes, one short rendered word from ``WORDS`` or a number 0-99 in a dark colour instead
of one of the shapes (at most one per scene, never the only object). Words and numbers are not shapes: they
are never counted, compared or described as shapes.

Question kinds (``KINDS``), every answer a short lowercase string without final punctuation:

* ``colour``   "What colour is the star?"                       -> "red"
* ``shape``    "What shape is the small blue object?"           -> "square"
* ``count``    "How many red shapes are there?"                 -> "two"     (number words, "zero" to "five";
  about ``ZERO_SHARE`` of the count questions ask about a colour or shape that is absent)
* ``position`` "Where is the green circle?"                     -> "left"    (left/right/top/bottom)
* ``relation`` "Is the red circle to the left of the star?"     -> "yes"/"no" (balanced within every scene), or
  "Which shape is above the green triangle?"                    -> "the red circle"
* ``reading``  "What word is written in the image?"             -> "cat"; "What number is shown?" -> "42"
* ``describe`` "Describe the image."  -> "a large red circle, the word cat and a small blue star" (left to right)

Objects are referred to only by a description that matches exactly one shape of the scene: its shape, colour,
size, or a combination ("the circle", "the red object", "the small star", "the large red circle"); a colour
question never names the colour and a shape question never names the shape. Answers that name an object use
"the {colour} {shape}", with the size in front ("the small red circle") only where colour and shape alone are
not unique.

Geometry, all in fractions of the image size (y grows downwards). Position is the shape's centre relative to
the image centre: the larger of |dx| and |dy| decides between left/right and top/bottom. It is asked only where
it is clear-cut (``position_clear``: the centre at least ``POSITION_MARGIN`` away from the diagonals and
``MIN_OFFSET`` away from the image centre); shapes are placed there, except in ``FREE_PROB`` of the scenes and
in scenes with a big shape, where they go anywhere they fit. "A is left of B"
is "yes" when B.cx - A.cx >= ``RELATION_MIN`` and that horizontal gap is at least ``RELATION_RATIO`` times the
vertical one, "no" when A.cx - B.cx >= ``RELATION_NO`` (A is clearly to the right), and not asked otherwise;
the same for right of / above / below. "Which shape is above B?" is asked only when exactly one object is "yes"
and every other object (the text included) is "no". The caption is given only when all horizontal distances
between object centres are at least ``ORDER_MARGIN``. Objects' bounding circles (radius ``extent``) are at
least ``GAP`` apart and lie inside the image.

Phrasings: ``tools/demo_vlm_phrasings`` holds them, some held out for the ``"eval"`` split. Layouts are held out
too: ``layout_split(scene)`` is a stable hash of the object count, the set of shapes (and "text") and the coarse
4x4 grid cells of the objects; about ``EVAL_LAYOUT_PERCENT`` % of layouts are ``"eval"``, and
``make_scene(rng, split)`` only returns scenes of its split.

API:

* ``KINDS``, ``SHAPES``, ``COLOURS`` (name -> RGB), ``WORDS``, ``IMAGE_SIZE``.
* ``make_scene(rng, split="train", n=None, text=None) -> dict``: ``{"objects": [...], "background": rgb,
  "noise": sigma, "noise_seed": int}``; a shape object is ``{"shape", "colour", "size", "cx", "cy", "extent",
  "rgb"}``, a text object ``{"text", "text_kind" ("word"/"number"), "cx", "cy", "extent", "half_w", "half_h",
  "font", "rgb"}``. ``n`` (objects) and ``text`` (bool) force those choices.
* ``render(scene, size=IMAGE_SIZE) -> PIL.Image`` (deterministic: the scene holds every random choice).
* ``questions(scene, rng, split="train") -> [(kind, question, answer), ...]``: every question the scene allows
  (relation yes/no subsampled to balance), one phrasing each, drawn from the split's templates.
* ``make_dataset(n, seed, split="train") -> [(image, [(kind, question, answer), ...]), ...]``: n scenes.
* ``make_eval_set(n_per_kind, seed) -> [(image, kind, question, answer), ...]``: eval layouts and templates,
  at least ``n_per_kind`` questions of every kind, single-object scenes included (``make_eval_scenes``: the
  same with the scene instead of its image).

``python -m tools.demo_vlm_data --out DIR [--n 12] [--seed 0] [--split train]`` writes PNGs and a
``questions.txt`` to look at.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import random
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from tools.demo_vlm_phrasings import split_templates

KINDS = ("colour", "shape", "count", "position", "relation", "reading", "describe")
SHAPES = ("circle", "square", "triangle", "star", "diamond")
COLOURS = {
    "red": (215, 30, 30),
    "green": (30, 150, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 200, 15),
    "purple": (130, 45, 180),
    "orange": (245, 130, 0),
    "black": (25, 25, 25),
    "pink": (245, 105, 185),
}
SIZES = {"small": (0.060, 0.075), "large": (0.120, 0.145)}  # extent (bounding-circle radius) ranges
BIG_EXTENT = {1: 0.38, 2: 0.26, 3: 0.20}  # a big large shape's extent, up to this by the scene's object count
BIG_PROB = 0.4
FREE_PROB = 0.25  # scenes whose shapes are placed anywhere, positions not asked where ambiguous
MIN_SIZE_RATIO = SIZES["large"][0] / SIZES["small"][1]  # 1.6
WORDS = (
    "cat", "dog", "sun", "car", "tree", "book", "fish", "bird", "milk", "red", "blue", "home",
    "star", "moon", "cake", "door", "hat", "cup", "bed", "box", "pen", "bus", "key", "rain",
)  # fmt: skip
TEXT_COLOURS = ((20, 20, 20), (20, 30, 110), (115, 20, 20), (15, 75, 30), (80, 45, 15))
BACKGROUNDS = ((248, 248, 248), (238, 238, 238), (246, 240, 224), (230, 238, 248), (232, 245, 232), (246, 236, 240))
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five")
POSITIONS = ("left", "right", "top", "bottom")
RELATIONS = {"left": "to the left of", "right": "to the right of", "above": "above", "below": "below"}

IMAGE_SIZE = 128
SUPERSAMPLE = 4
TEXT_PROB = 0.35  # share of scenes with a word or a number
TEXT_FONT = (0.17, 0.21)  # font size range (fraction of the image size)
BORDER = 0.02  # min distance of a bounding circle from the image border
POSITION_MARGIN = 0.08
MIN_OFFSET = 0.16
GAP = 0.03
ORDER_MARGIN = 0.06
RELATION_MIN, RELATION_RATIO, RELATION_NO = 0.12, 1.5, 0.06
ZERO_SHARE = 0.15
EVAL_LAYOUT_PERCENT = 10

# ---------------------------------------------------------------------------------------------- geometry


def position_of(cx: float, cy: float) -> str:
    """'left'/'right'/'top'/'bottom' of a centre given in fractions of the image size (0..1, y down)."""
    dx, dy = cx - 0.5, cy - 0.5
    if abs(dx) > abs(dy):
        return "right" if dx > 0 else "left"
    return "bottom" if dy > 0 else "top"


def position_clear(cx: float, cy: float) -> bool:
    """Whether ``position_of`` is clear-cut: the centre far enough from the diagonals and the image centre."""
    dx, dy = abs(cx - 0.5), abs(cy - 0.5)
    return abs(dx - dy) >= POSITION_MARGIN and max(dx, dy) >= MIN_OFFSET


def relation(a: dict, b: dict, rel: str) -> str | None:
    """'yes'/'no' to "is a {rel} b?" (rel: left/right/above/below), or None where that is not clear-cut."""
    along, across = {"left": (b["cx"] - a["cx"], a["cy"] - b["cy"]), "right": (a["cx"] - b["cx"], a["cy"] - b["cy"]),
                     "above": (b["cy"] - a["cy"], a["cx"] - b["cx"]),
                     "below": (a["cy"] - b["cy"], a["cx"] - b["cx"])}[rel]  # fmt: skip
    if along >= RELATION_MIN and along >= RELATION_RATIO * abs(across):
        return "yes"
    if along <= -RELATION_NO:
        return "no"
    return None


def layout_split(scene: dict) -> str:
    """'train' or 'eval' from a stable hash of the layout: object count, shape set and coarse 4x4 grid cells."""
    objects = scene["objects"]
    kinds = sorted({o.get("shape", "text") for o in objects})
    cells = sorted((min(int(o["cx"] * 4), 3), min(int(o["cy"] * 4), 3)) for o in objects)
    key = f"{len(objects)}|{','.join(kinds)}|{cells}".encode()
    return "eval" if int(hashlib.sha256(key).hexdigest(), 16) % 100 < EVAL_LAYOUT_PERCENT else "train"


@functools.lru_cache(maxsize=64)
def _font(px: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=px)


def _text_box(text: str, font: float, canvas: int) -> tuple[float, float, float, float]:
    """Ink box (left, top, right, bottom) in pixels of text drawn at the origin on a canvas x canvas image."""
    return _font(max(1, round(font * canvas))).getbbox(text)


def _fits(cx: float, cy: float, extent: float, placed: list[dict]) -> bool:
    if not (extent + BORDER <= cx <= 1 - extent - BORDER and extent + BORDER <= cy <= 1 - extent - BORDER):
        return False
    return all(math.hypot(cx - o["cx"], cy - o["cy"]) >= extent + o["extent"] + GAP for o in placed)


def _place_text(rng: random.Random, obj: dict, placed: list[dict]) -> bool:
    left, top, right, bottom = _text_box(obj["text"], obj["font"], IMAGE_SIZE * SUPERSAMPLE)
    canvas = IMAGE_SIZE * SUPERSAMPLE
    obj["half_w"], obj["half_h"] = (right - left) / canvas / 2, (bottom - top) / canvas / 2
    obj["extent"] = math.hypot(obj["half_w"], obj["half_h"]) + 0.01
    for _ in range(100):
        cx, cy = rng.uniform(0, 1), rng.uniform(0, 1)
        if _fits(cx, cy, obj["extent"], placed):
            obj["cx"], obj["cy"] = cx, cy
            return True
    return False


def _place_shape(rng: random.Random, obj: dict, placed: list[dict], free: bool) -> bool:
    for _ in range(200):
        cx, cy = rng.uniform(0, 1), rng.uniform(0, 1)
        if not free and not position_clear(cx, cy):
            continue
        if _fits(cx, cy, obj["extent"], placed):
            obj["cx"], obj["cy"] = cx, cy
            return True
    return False


def _draw_scene(rng: random.Random, n: int | None, text: bool | None) -> dict:
    n = n if n is not None else rng.randint(2 if text else 1, 5)
    if text is None:
        text = n >= 2 and rng.random() < TEXT_PROB * 5 / 4  # about TEXT_PROB of all scenes
    if text and n < 2:
        raise ValueError("a text object needs at least one shape beside it")
    while True:
        objects: list[dict] = []
        if text:
            if rng.random() < 0.6:
                word, text_kind = rng.choice(WORDS), "word"
            else:
                word, text_kind = str(rng.randint(0, 99)), "number"
            objects.append({"text": word, "text_kind": text_kind, "font": rng.uniform(*TEXT_FONT),
                            "rgb": rng.choice(TEXT_COLOURS)})  # fmt: skip
        big = False
        for _ in range(n - len(objects)):
            size = rng.choice(tuple(SIZES))
            colour = rng.choice(tuple(COLOURS))
            rgb = tuple(min(255, max(0, c + rng.randint(-10, 10))) for c in COLOURS[colour])
            extent = rng.uniform(*SIZES[size])
            if size == "large" and n in BIG_EXTENT and rng.random() < BIG_PROB:
                extent, big = rng.uniform(SIZES["large"][1], BIG_EXTENT[n]), True
            objects.append({"shape": rng.choice(SHAPES), "colour": colour, "size": size, "extent": extent,
                            "rgb": rgb})  # fmt: skip
        free = big or rng.random() < FREE_PROB
        placed: list[dict] = []
        # the text and large shapes first: they are the hardest to fit
        for obj in sorted(objects, key=lambda o: ("shape" in o, -o.get("extent", 1.0))):
            ok = _place_text(rng, obj, placed) if "text" in obj else _place_shape(rng, obj, placed, free)
            if not ok:
                break
            placed.append(obj)
        if len(placed) == n:
            break
    base = rng.choice(BACKGROUNDS)
    return {
        "objects": objects,
        "background": tuple(min(255, max(0, c + rng.randint(-5, 5))) for c in base),
        "noise": rng.uniform(2.0, 8.0) if rng.random() < 0.5 else 0.0,
        "noise_seed": rng.getrandbits(32),
    }


def make_scene(rng: random.Random, split: str = "train", n: int | None = None, text: bool | None = None) -> dict:
    """A random scene whose layout belongs to ``split`` (resampled until it does)."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}")
    while True:
        scene = _draw_scene(rng, n, text)
        if layout_split(scene) == split:
            return scene


# --------------------------------------------------------------------------------------------- rendering


def _shape_points(shape: str, cx: float, cy: float, e: float) -> list[tuple[float, float]]:
    if shape == "triangle":  # equilateral, pointing up, inscribed in the bounding circle
        return [(cx + e * math.sin(a), cy - e * math.cos(a)) for a in (0.0, 2 * math.pi / 3, 4 * math.pi / 3)]
    if shape == "star":  # five points, inner radius 0.45
        return [
            (cx + r * math.sin(i * math.pi / 5), cy - r * math.cos(i * math.pi / 5))
            for i in range(10)
            for r in [e if i % 2 == 0 else 0.45 * e]
        ]
    if shape == "diamond":  # a square on its corner, a little taller than wide
        return [(cx, cy - e), (cx + 0.75 * e, cy), (cx, cy + e), (cx - 0.75 * e, cy)]
    raise ValueError(f"unknown shape {shape!r}")


def _draw_object(draw: ImageDraw.ImageDraw, o: dict, big: int) -> None:
    cx, cy = o["cx"] * big, o["cy"] * big
    if "text" in o:
        left, top, right, bottom = _text_box(o["text"], o["font"], big)
        xy = (cx - (left + right) / 2, cy - (top + bottom) / 2)  # centre the ink box on (cx, cy)
        draw.text(xy, o["text"], fill=o["rgb"], font=_font(max(1, round(o["font"] * big))))
        return
    e = o["extent"] * big
    if o["shape"] == "circle":
        r = 0.9 * e
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=o["rgb"])
    elif o["shape"] == "square":
        h = 0.7 * e  # corners on the bounding circle
        draw.rectangle((cx - h, cy - h, cx + h, cy + h), fill=o["rgb"])
    else:
        draw.polygon(_shape_points(o["shape"], cx, cy, e), fill=o["rgb"])


def render(scene: dict, size: int = IMAGE_SIZE) -> Image.Image:
    """The scene as a size x size RGB image (anti-aliased; the same image for the same scene)."""
    big = size * SUPERSAMPLE
    image = Image.new("RGB", (big, big), tuple(scene["background"]))
    draw = ImageDraw.Draw(image)
    for o in scene["objects"]:
        _draw_object(draw, o, big)
    image = image.resize((size, size), Image.Resampling.BOX)
    if scene["noise"] > 0:
        noise = np.random.default_rng(scene["noise_seed"]).normal(0.0, scene["noise"], (size, size, 3))
        image = Image.fromarray(np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8))
    return image


# --------------------------------------------------------------------------------------------- questions


def _article(word: str) -> str:
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
    for o in sorted(objects, key=lambda o: o["cx"]):
        if "text" in o:
            parts.append(f"the {o['text_kind']} {o['text']}")
        else:
            parts.append(f"{_article(o['size'])} {o['size']} {o['colour']} {o['shape']}")
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _fill(template: str, **values: str) -> str:
    if "{Obj}" in template:
        values["Obj"] = values["obj"][0].upper() + values["obj"][1:]
    return template.format(**values)


def questions(scene: dict, rng: random.Random, split: str = "train") -> list[tuple[str, str, str]]:
    """Every (kind, question, answer) the scene allows, one phrasing each from the split's templates."""
    objects = scene["objects"]
    shapes = [o for o in objects if "text" not in o]
    texts = [o for o in objects if "text" in o]
    tpl = {kind: split_templates(kind, split) for kind in KINDS}
    out: list[tuple[str, str, str]] = []

    def ask(kind: str, answer: str, templates: list[str] | None = None, **values: str) -> None:
        out.append((kind, _fill(rng.choice(templates or tpl[kind]), **values), answer))

    for s in shapes:
        if refs := references(s, shapes, without="colour"):
            ask("colour", s["colour"], obj=rng.choice(refs))
    for s in shapes:
        if refs := references(s, shapes, without="shape"):
            ask("shape", s["shape"], obj=rng.choice(refs))

    # count: all shapes, per colour / shape / size present, plus a few absent colours and shapes ("zero")
    groups = [("shapes", len(shapes))]
    for attr, names, noun in (("colour", COLOURS, "{} shapes"), ("shape", SHAPES, "{}s"), ("size", SIZES, "{} shapes")):
        present = Counter(s[attr] for s in shapes)
        groups += [(noun.format(name), present[name]) for name in names if present[name]]
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


# ------------------------------------------------------------------------------------------------ datasets


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
    images: dict[int, Image.Image] = {}
    return [(images.setdefault(id(scene), render(scene)), kind, question, answer)
            for scene, kind, question, answer in make_eval_scenes(n_per_kind, seed)]  # fmt: skip


def make_eval_scenes(n_per_kind: int, seed: int) -> list[tuple[dict, str, str, str]]:
    """Eval layouts and held-out phrasings: at least n_per_kind (scene, kind, question, answer) of every kind,
    one question per kind per scene; every fourth scene has a single object, every third one a text. Among a
    scene's questions of a kind, the one whose answer class (yes / no / which for relation, the answer for count
    and position) is the rarest so far is taken, so that those answers come out balanced."""
    rng = random.Random(seed)
    counts = dict.fromkeys(KINDS, 0)
    seen: Counter = Counter()

    def answer_class(kind: str, answer: str) -> str | None:
        if kind == "relation":
            return answer if answer in ("yes", "no") else "which"
        return answer if kind in ("count", "position") else None

    out = []
    i = 0
    while min(counts.values()) < n_per_kind:
        n = 1 if i % 4 == 0 else None
        text = False if n == 1 else (True if i % 3 == 0 else None)
        i += 1
        scene = make_scene(rng, "eval", n=n, text=text)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for sample PNGs and questions.txt")
    parser.add_argument("--n", "-n", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=("train", "eval"), default="train")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (image, qas) in enumerate(make_dataset(args.n, args.seed, args.split)):
        image.save(args.out / f"{i:03d}.png")
        lines += [f"{i:03d}.png\t{kind}\t{question}\t{answer}" for kind, question, answer in qas]
    (args.out / "questions.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
