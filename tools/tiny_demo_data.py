"""Synthetic visual question answering for the bundled demo model (seeded, deterministic).

A scene is 1-3 non-overlapping shapes (circle, square, triangle) in six colours on a light, plain or
lightly noisy background. Each example is one question of one of five kinds:

* ``colour``   "What colour is the circle?"      -> "red"        (asked only of a shape type that occurs once)
* ``shape``    "What shape is the blue object?"  -> "square"     (asked only of a colour that occurs once)
* ``count``    "How many shapes are there?"      -> "two"        (always a number word: one, two, three)
* ``position`` "Where is the triangle?"          -> "left"       (asked only of a shape type that occurs once)
* ``describe`` "Describe the image."             -> "a red circle, a blue square and a green triangle"

Position is the shape's centre relative to the image centre: whichever of |dx| and |dy| is larger decides
between left/right and top/bottom (y grows downwards, so dy < 0 is "top"). Every shape is placed at least
``POSITION_MARGIN`` of the image size away from the diagonals (where |dx| == |dy|) and at least ``MIN_OFFSET``
away from the centre, so the answer is never ambiguous. The caption lists the shapes left to right; their
centres are at least ``ORDER_MARGIN`` apart horizontally so that order is unambiguous too.

``make_example(rng)`` returns ``(image, question, answer, kind)``; ``make_dataset(n, seed)`` returns a list
of n such tuples (the same list for the same seed). ``python -m tools.tiny_demo_data --out DIR`` writes a few
examples as PNG files with a ``questions.txt``, to look at.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

KINDS = ("colour", "shape", "count", "position", "describe")
SHAPES = ("circle", "square", "triangle")
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 225),
    "yellow": (240, 205, 20),
    "purple": (140, 50, 185),
    "orange": (250, 135, 0),
}
NUMBER_WORDS = ("zero", "one", "two", "three")
POSITIONS = ("left", "right", "top", "bottom")

IMAGE_SIZE = 64  # default output size (the demo model's input size)
SUPERSAMPLE = 4  # shapes are drawn this many times larger, then downscaled (anti-aliased edges)
MIN_HALF, MAX_HALF = 0.08, 0.15  # a shape's half-extent, as a fraction of the image size
POSITION_MARGIN = 0.10  # min ||dx| - |dy|| of every shape centre (fraction of the image size)
MIN_OFFSET = 0.16  # min max(|dx|, |dy|) of every shape centre
ORDER_MARGIN = 0.08  # min horizontal distance between two shape centres
GAP = 0.03  # min distance between the bounding circles of two shapes

QUESTIONS = {
    "colour": "What colour is the {shape}?",
    "shape": "What shape is the {colour} object?",
    "count": "How many shapes are there?",
    "position": "Where is the {shape}?",
    "describe": "Describe the image.",
}


def position_of(cx: float, cy: float) -> str:
    """'left'/'right'/'top'/'bottom' of a centre given in fractions of the image size (0..1, y down)."""
    dx, dy = cx - 0.5, cy - 0.5
    if abs(dx) > abs(dy):
        return "right" if dx > 0 else "left"
    return "bottom" if dy > 0 else "top"


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def describe(shapes: list[dict]) -> str:
    """'a red circle', 'a red circle and a blue square', 'a red circle, a blue square and a green triangle'."""
    parts = [_article(s["colour"]) + f" {s['colour']} {s['shape']}" for s in sorted(shapes, key=lambda s: s["cx"])]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _place(rng: random.Random, n: int) -> list[tuple[float, float, float]]:
    """n (cx, cy, half) triples, in fractions of the image size, satisfying every margin above."""
    while True:
        placed: list[tuple[float, float, float]] = []
        for _ in range(200):
            half = rng.uniform(MIN_HALF, MAX_HALF)
            cx, cy = rng.uniform(half, 1 - half), rng.uniform(half, 1 - half)
            dx, dy = abs(cx - 0.5), abs(cy - 0.5)
            if abs(dx - dy) < POSITION_MARGIN or max(dx, dy) < MIN_OFFSET:
                continue
            if any(
                abs(cx - ox) < ORDER_MARGIN or (cx - ox) ** 2 + (cy - oy) ** 2 < (half + oh + GAP) ** 2
                for ox, oy, oh in placed
            ):
                continue
            placed.append((cx, cy, half))
            if len(placed) == n:
                return placed
        # ran out of tries with an awkward early placement: start again


def make_scene(rng: random.Random, n: int | None = None) -> list[dict]:
    n = n if n is not None else rng.randint(1, 3)
    return [
        {"shape": rng.choice(SHAPES), "colour": rng.choice(list(COLOURS)), "cx": cx, "cy": cy, "half": half}
        for cx, cy, half in _place(rng, n)
    ]


def draw_shape(draw: ImageDraw.ImageDraw, s: dict, size: int, fill) -> None:
    """Draw one shape of the scene on a size x size canvas."""
    cx, cy, h = s["cx"] * size, s["cy"] * size, s["half"] * size
    if s["shape"] == "circle":
        draw.ellipse((cx - h, cy - h, cx + h, cy + h), fill=fill)
    elif s["shape"] == "square":
        h *= 0.9  # about the same area as the circle
        draw.rectangle((cx - h, cy - h, cx + h, cy + h), fill=fill)
    else:  # upward triangle; its centroid-ish centre at (cx, cy)
        draw.polygon([(cx, cy - h), (cx + h, cy + h * 0.8), (cx - h, cy + h * 0.8)], fill=fill)


def render(rng: random.Random, shapes: list[dict], size: int = IMAGE_SIZE) -> Image.Image:
    """Draw the scene on a light background (plain or lightly noisy), anti-aliased, size x size RGB."""
    big = size * SUPERSAMPLE
    base = rng.randint(205, 250)
    background = tuple(min(255, max(0, base + rng.randint(-12, 12))) for _ in range(3))
    image = Image.new("RGB", (big, big), background)
    draw = ImageDraw.Draw(image)
    for s in shapes:
        colour = tuple(min(255, max(0, c + rng.randint(-15, 15))) for c in COLOURS[s["colour"]])
        draw_shape(draw, s, big, colour)
    image = image.resize((size, size), Image.Resampling.BOX)
    if rng.random() < 0.5:  # lightly textured: Gaussian pixel noise
        sigma = rng.uniform(3.0, 12.0)
        noise = np.random.default_rng(rng.getrandbits(32)).normal(0.0, sigma, (size, size, 3))
        image = Image.fromarray(np.clip(np.asarray(image, dtype=np.float32) + noise, 0, 255).astype(np.uint8))
    return image


def _ask(rng: random.Random, kind: str, shapes: list[dict]) -> tuple[str, str] | None:
    """(question, answer) of this kind about the scene, or None where the scene allows no such question."""
    if kind == "count":
        return QUESTIONS[kind], NUMBER_WORDS[len(shapes)]
    if kind == "describe":
        return QUESTIONS[kind], describe(shapes)
    if kind in ("colour", "position"):
        unique = [s for s in shapes if sum(o["shape"] == s["shape"] for o in shapes) == 1]
        if not unique:
            return None
        s = rng.choice(unique)
        answer = s["colour"] if kind == "colour" else position_of(s["cx"], s["cy"])
        return QUESTIONS[kind].format(shape=s["shape"]), answer
    if kind == "shape":
        unique = [s for s in shapes if sum(o["colour"] == s["colour"] for o in shapes) == 1]
        if not unique:
            return None
        s = rng.choice(unique)
        return QUESTIONS[kind].format(colour=s["colour"]), s["shape"]
    raise ValueError(f"unknown question kind {kind!r}")


def make_scene_with_questions(rng: random.Random, size: int = IMAGE_SIZE):
    """(image, [(question, answer, kind), ...]): one question of every kind the scene allows."""
    shapes = make_scene(rng)
    qas = [(qa[0], qa[1], kind) for kind in KINDS if (qa := _ask(rng, kind, shapes)) is not None]
    return render(rng, shapes, size), qas


def make_example(rng: random.Random, size: int = IMAGE_SIZE, kind: str | None = None):
    """(PIL image, question, answer, kind); the kind is drawn uniformly unless given."""
    kind = kind or rng.choice(KINDS)
    while True:
        shapes = make_scene(rng)
        qa = _ask(rng, kind, shapes)
        if qa is not None:
            return render(rng, shapes, size), qa[0], qa[1], kind


def make_dataset(n: int, seed: int, size: int = IMAGE_SIZE) -> list[tuple[Image.Image, str, str, str]]:
    rng = random.Random(seed)
    return [make_example(rng, size) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for sample PNGs and questions.txt")
    parser.add_argument("-n", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=IMAGE_SIZE)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (image, question, answer, kind) in enumerate(make_dataset(args.n, args.seed, args.size)):
        image.save(args.out / f"{i:03d}.png")
        lines.append(f"{i:03d}.png\t{kind}\t{question}\t{answer}")
    (args.out / "questions.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
