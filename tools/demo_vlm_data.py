"""Richer synthetic visual question answering for the ViT + SmolLM2 demo VLM (seeded, deterministic).

A scene is one to five non-overlapping objects on a light background (plain or lightly noisy, one of a few
light tints), drawn ``SUPERSAMPLE`` times larger and downscaled (anti-aliased), ``IMAGE_SIZE`` x ``IMAGE_SIZE``
RGB. An object is a shape (``SHAPES``) in one of ``COLOURS``, ``small`` or ``large`` (a large shape's extent is
at least ``MIN_SIZE_RATIO`` times a small one's; in scenes of up to three objects, ``BIG_PROB`` of the large
shapes are big, up to ``BIG_EXTENT[n]``: people draw a lone shape big, often in the middle), or, in about
``TEXT_PROB`` of the scenes, one short rendered word from ``WORDS`` or a number 0-99 in a dark colour instead
of one of the shapes (at most one per scene, never the only object). Words and numbers are not shapes: they
are never counted, compared or described as shapes.

The questions about a scene are in ``tools/demo_vlm_questions.py`` (base kinds) and
``tools/demo_vlm_user_kinds.py``; ``tools/demo_vlm_datasets.py`` draws datasets of both; pictures that are not
shapes scenes at all are in ``tools/demo_vlm_pictures.py`` (``render`` draws them too).

Colours are drawn in one of their ``PALETTES`` shades (ours, then the named colours people draw with: PIL's
"orange" is not our orange), jittered. In ``MIDDLE_PROB`` of the scenes the largest shape goes in the middle, and
in ``CORNER_PROB`` of those of four or five shapes (no text), they go in the corners (the fifth in the middle).

Geometry, all in fractions of the image size (y grows downwards). Position is the shape's centre relative to
the image centre: "middle" when both |dx| and |dy| are under ``MIDDLE``, else the larger of |dx| and |dy| decides
between left/right and top/bottom. It is asked only where it is clear-cut (``position_clear``: the centre within
``MIDDLE_CLEAR`` of the image centre, or at least ``POSITION_MARGIN`` away from the diagonals and ``MIN_OFFSET``
away from the image centre); shapes are placed there, except in ``FREE_PROB`` of the scenes and
in scenes with a big shape, where they go anywhere they fit. "A is left of B"
is "yes" when B.cx - A.cx >= ``RELATION_MIN`` and that horizontal gap is at least ``RELATION_RATIO`` times the
vertical one, "no" when A.cx - B.cx >= ``RELATION_NO`` (A is clearly to the right), and not asked otherwise;
the same for right of / above / below. Objects' bounding circles (radius ``extent``) are at
least ``GAP`` apart and lie inside the image.

Layouts are held out for evaluation: ``layout_split(scene)`` is a stable hash of the object count, the set of
shapes (and "text") and the coarse 4x4 grid cells of the objects; about ``EVAL_LAYOUT_PERCENT`` % of layouts are
``"eval"``, and ``make_scene(rng, split)`` only returns scenes of its split.

API:

* ``SHAPES``, ``COLOURS`` (name -> RGB), ``POSITIONS``, ``WORDS``, ``IMAGE_SIZE``.
* ``make_scene(rng, split="train", n=None, text=None) -> dict``: ``{"objects": [...], "background": rgb,
  "noise": sigma, "noise_seed": int}``; a shape object is ``{"shape", "colour", "size", "cx", "cy", "extent",
  "rgb"}``, a text object ``{"text", "text_kind" ("word"/"number"), "cx", "cy", "extent", "half_w", "half_h",
  "font", "rgb"}``. ``n`` (objects) and ``text`` (bool) force those choices.
* ``render(scene, size=IMAGE_SIZE) -> PIL.Image`` (deterministic: the scene holds every random choice).
* ``position_of``, ``position_clear``, ``relation``: the geometry the questions ask about.
* ``left_to_right``, ``top_to_bottom``: the objects' reading order and row ranks (``SLANT``);
  ``align_pair(scene, rng)``: two objects put in one column or row (encoder training).

``python -m tools.demo_vlm_data --out DIR [--n 12] [--seed 0] [--split train]`` writes PNGs and a
``questions.txt`` to look at.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from tools.demo_vlm_pictures import picture_split, render_picture

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
    "brown": (135, 75, 30),
    "grey": (128, 128, 128),
}
# The shades a colour is drawn in: ours first, then the named colours people draw with (PIL's / CSS's "red",
# "orange", "purple", ... and their common darker or lighter relatives that keep the name).
PALETTES = {
    "red": (COLOURS["red"], (255, 0, 0), (220, 20, 60), (200, 0, 0)),
    "green": (COLOURS["green"], (0, 128, 0), (0, 255, 0), (34, 139, 34), (50, 205, 50), (0, 100, 0)),
    "blue": (COLOURS["blue"], (0, 0, 255), (65, 105, 225), (30, 144, 255), (0, 0, 139), (0, 0, 128)),
    "yellow": (COLOURS["yellow"], (255, 255, 0), (255, 215, 0), (250, 225, 50)),
    "purple": (COLOURS["purple"], (128, 0, 128), (148, 0, 211), (138, 43, 226), (153, 50, 204), (102, 51, 153)),
    "orange": (COLOURS["orange"], (255, 165, 0), (255, 140, 0), (250, 150, 40)),
    "black": (COLOURS["black"], (0, 0, 0), (45, 45, 45)),
    "pink": (COLOURS["pink"], (255, 192, 203), (255, 105, 180), (255, 20, 147), (255, 182, 193), (240, 128, 170)),
    "brown": (COLOURS["brown"], (165, 42, 42), (139, 69, 19), (160, 82, 45), (120, 60, 20), (150, 100, 50)),
    "grey": (COLOURS["grey"], (169, 169, 169), (105, 105, 105), (150, 150, 150), (112, 128, 144)),
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
POSITIONS = ("left", "right", "top", "bottom", "middle")
RELATIONS = {"left": "to the left of", "right": "to the right of", "above": "above", "below": "below"}

IMAGE_SIZE = 128
SUPERSAMPLE = 4
TEXT_PROB = 0.35  # share of scenes with a word or a number
TEXT_FONT = (0.17, 0.21)  # font size range (fraction of the image size)
BORDER = 0.02  # min distance of a bounding circle from the image border
POSITION_MARGIN = 0.08
MIN_OFFSET = 0.16
MIDDLE, MIDDLE_CLEAR = 0.10, 0.06  # a centre this close to the image centre (on both axes) is "middle" / clearly
MIDDLE_PROB = 0.2  # scenes whose largest shape is put in the middle
CORNER_PROB = 0.15  # scenes of four or five shapes drawn in the corners (and the middle), as people draw them
CORNERS = ((0.25, 0.25), (0.75, 0.25), (0.25, 0.75), (0.75, 0.75))
GAP = 0.03
ORDER_MARGIN = 0.06
RELATION_MIN, RELATION_RATIO, RELATION_NO = 0.12, 1.5, 0.06
# the slots' record order runs along lines this far off the vertical (and their row ranks off the horizontal): an
# object exactly above another is listed first, not in drawing order, which the image does not show; under
# ORDER_MARGIN / RELATION_NO, so every pair a description or relation is asked about keeps its order by x (by y)
SLANT = 0.05
assert SLANT < min(ORDER_MARGIN, RELATION_NO)
ALIGN_TRIES = 20
ZERO_SHARE = 0.15
EVAL_LAYOUT_PERCENT = 10

# ---------------------------------------------------------------------------------------------- geometry


def position_of(cx: float, cy: float) -> str:
    """'left'/'right'/'top'/'bottom'/'middle' of a centre given in fractions of the image size (0..1, y down)."""
    dx, dy = cx - 0.5, cy - 0.5
    if max(abs(dx), abs(dy)) < MIDDLE:
        return "middle"
    if abs(dx) > abs(dy):
        return "right" if dx > 0 else "left"
    return "bottom" if dy > 0 else "top"


def position_clear(cx: float, cy: float) -> bool:
    """Whether ``position_of`` is clear-cut: the centre far enough from the diagonals and the image centre, or
    close to the centre ("middle")."""
    dx, dy = abs(cx - 0.5), abs(cy - 0.5)
    if max(dx, dy) < MIDDLE_CLEAR:
        return True
    return abs(dx - dy) >= POSITION_MARGIN and max(dx, dy) >= MIN_OFFSET


def left_to_right(objects: list[dict]) -> list[int]:
    """The objects' indices in reading order, the slots' records and descriptions: by the centre's x, which
    ``SLANT`` times its y shifts (one above the other, the upper one first)."""
    return sorted(range(len(objects)), key=lambda i: objects[i]["cx"] + SLANT * objects[i]["cy"])


def top_to_bottom(objects: list[dict]) -> list[int]:
    """The objects' indices from the top (the row ranks): by the centre's y, which ``SLANT`` times its x shifts
    (side by side, the left one first)."""
    return sorted(range(len(objects)), key=lambda i: objects[i]["cy"] + SLANT * objects[i]["cx"])


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
    """'train' or 'eval' from a stable hash of the layout: object count, shape set and coarse 4x4 grid cells (of a
    picture with no shapes, of its seed)."""
    if "picture" in scene:
        return picture_split(scene["picture"]["seed"])
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


def _place_shape(
    rng: random.Random, obj: dict, placed: list[dict], free: bool, anchor: tuple[float, float] | None = None
) -> bool:
    """Somewhere it fits (near `anchor` when given: the middle or a corner), clear of the diagonals unless
    `free`."""
    if anchor is not None:
        for _ in range(50):
            cx, cy = (a + rng.uniform(-MIDDLE_CLEAR, MIDDLE_CLEAR) for a in anchor)
            if _fits(cx, cy, obj["extent"], placed):
                obj["cx"], obj["cy"] = cx, cy
                return True
    for _ in range(200):
        cx, cy = rng.uniform(0, 1), rng.uniform(0, 1)
        if not free and not position_clear(cx, cy):
            continue
        if _fits(cx, cy, obj["extent"], placed):
            obj["cx"], obj["cy"] = cx, cy
            return True
    return False


def _anchors(rng: random.Random, objects: list[dict]) -> list[tuple[float, float]]:
    """Where the shapes (largest first) go, if anywhere in particular: the corners (four or five shapes, no text,
    the fifth in the middle) or the middle (the largest shape)."""
    shapes = sum("shape" in o for o in objects)
    if shapes == len(objects) >= 4 and all(o["extent"] <= SIZES["large"][1] for o in objects):
        if rng.random() < CORNER_PROB:
            corners = rng.sample(CORNERS, 4)
            return [(0.5, 0.5), *corners] if shapes == 5 else corners
    return [(0.5, 0.5)] if rng.random() < MIDDLE_PROB else []


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
            rgb = tuple(min(255, max(0, c + rng.randint(-10, 10))) for c in rng.choice(PALETTES[colour]))
            extent = rng.uniform(*SIZES[size])
            if size == "large" and n in BIG_EXTENT and rng.random() < BIG_PROB:
                extent, big = rng.uniform(SIZES["large"][1], BIG_EXTENT[n]), True
            objects.append({"shape": rng.choice(SHAPES), "colour": colour, "size": size, "extent": extent,
                            "rgb": rgb})  # fmt: skip
        free = big or rng.random() < FREE_PROB
        anchors = _anchors(rng, objects)
        placed: list[dict] = []
        # the text and large shapes first: they are the hardest to fit
        for obj in sorted(objects, key=lambda o: ("shape" in o, -o.get("extent", 1.0))):
            if "text" in obj:
                ok = _place_text(rng, obj, placed)
            else:
                ok = _place_shape(rng, obj, placed, free, anchors.pop(0) if anchors else None)
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


def align_pair(scene: dict, rng: random.Random) -> dict:
    """The scene with two of its objects put exactly in one column (or row), as people draw them, where that still
    fits and keeps the layout's split; else unchanged. Training data for the order ``SLANT`` breaks."""
    objects = scene["objects"]
    split = layout_split(scene)
    for _ in range(ALIGN_TRIES if len(objects) >= 2 else 0):
        a, b = rng.sample(objects, 2)
        axis = rng.choice(("cx", "cy"))
        moved = {**b, axis: a[axis]}
        others = [o for o in objects if o is not b]
        aligned = {**scene, "objects": [moved if o is b else o for o in objects]}
        if _fits(moved["cx"], moved["cy"], moved["extent"], others) and layout_split(aligned) == split:
            return aligned
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
    if "picture" in scene:
        return render_picture(scene["picture"], size)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for sample PNGs and questions.txt")
    parser.add_argument("--n", "-n", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", choices=("train", "eval"), default="train")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from tools.demo_vlm_datasets import make_dataset  # the questions are built on this module

    lines = []
    for i, (image, qas) in enumerate(make_dataset(args.n, args.seed, args.split)):
        image.save(args.out / f"{i:03d}.png")
        lines += [f"{i:03d}.png\t{kind}\t{question}\t{answer}" for kind, question, answer in qas]
    (args.out / "questions.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
