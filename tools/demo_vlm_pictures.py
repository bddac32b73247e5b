"""Pictures that are not shapes scenes, for the demo VLM's honesty: asked about a photograph, noise, a gradient or
a line drawing, it must say that it sees no simple shapes instead of inventing a caption.

``make_picture(rng)`` draws one as a scene with no objects (``{"objects": [], "picture": {"family", "seed"}}``),
so that everything built on scenes takes it as is: its slots are all fillers, its per-patch targets all
"nothing", and ``demo_vlm_data.render`` draws it with ``render_picture``. The families (``FAMILIES``):

* ``blank``     the scenes' own light backgrounds, plain or noisy, with nothing on them;
* ``noise``     colour noise, fine or coarse (blocks, or smoothly upsampled);
* ``gradient``  linear or radial blends of two or three colours;
* ``photo``     photograph-like: smooth random fields at several scales in natural palettes (sky, grass,
  skin, wood, water), a horizon, soft blobs, film grain;
* ``strokes``   a line drawing: thin lines, arcs and scribbles, none of them closed or filled;
* ``stripes``   waves and stripes at any angle.

The picture is a function of its seed; ``picture_split`` holds out about ``EVAL_PERCENT`` % of the seeds for
evaluation, as ``demo_vlm_data.layout_split`` does for layouts.
"""

from __future__ import annotations

import hashlib
import math
import random

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

FAMILIES = ("blank", "noise", "gradient", "photo", "strokes", "stripes")
EVAL_PERCENT = 10
LIGHT = ((248, 248, 248), (238, 238, 238), (246, 240, 224), (230, 238, 248), (232, 245, 232), (255, 255, 255))
NATURAL = (  # (dark, light) pairs a photograph's regions blend between
    ((40, 90, 170), (200, 225, 250)),  # sky
    ((30, 80, 20), (150, 200, 90)),  # grass, leaves
    ((120, 70, 50), (240, 200, 170)),  # skin, sand
    ((70, 40, 20), (190, 140, 90)),  # wood, earth
    ((10, 50, 80), (90, 170, 200)),  # water
    ((60, 60, 65), (220, 220, 215)),  # stone, concrete
)


def picture_split(seed: int) -> str:
    return "eval" if int(hashlib.sha256(f"picture|{seed}".encode()).hexdigest(), 16) % 100 < EVAL_PERCENT else "train"


def make_picture(rng: random.Random, split: str = "train", family: str | None = None) -> dict:
    """A non-shapes picture of the split, as a scene with no objects."""
    family = family or rng.choice(FAMILIES)
    while picture_split(seed := rng.getrandbits(32)) != split:
        pass
    return {"objects": [], "picture": {"family": family, "seed": seed}, "background": LIGHT[0], "noise": 0.0,
            "noise_seed": seed}  # fmt: skip


def _field(rng: np.random.Generator, size: int, cells: int) -> np.ndarray:
    """[size, size] smooth random values in 0..1: a cells x cells random grid, bicubically upsampled."""
    grid = Image.fromarray((rng.random((cells, cells)) * 255).astype(np.uint8))
    return np.asarray(grid.resize((size, size), Image.Resampling.BICUBIC), dtype=np.float32) / 255


def _blend(t: np.ndarray, a, b) -> np.ndarray:
    """[H, W] weights -> [H, W, 3] colours from a (at 0) to b (at 1)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a + (b - a) * np.clip(t, 0, 1)[..., None]


def _colour(rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(c) for c in rng.integers(0, 256, 3))


def _noise(rng: np.random.Generator, size: int) -> np.ndarray:
    cells = int(rng.choice([4, 8, 16, 32, size]))
    values = rng.integers(0, 256, (cells, cells, 3), dtype=np.uint8)
    if rng.random() < 0.5:  # monochrome-ish noise around one colour
        values = np.clip(np.asarray(_colour(rng)) + rng.normal(0, 40, (cells, cells, 1)), 0, 255).astype(np.uint8)
    resample = Image.Resampling.NEAREST if rng.random() < 0.5 else Image.Resampling.BICUBIC
    return np.asarray(Image.fromarray(values).resize((size, size), resample), dtype=np.float32)


def _gradient(rng: np.random.Generator, size: int) -> np.ndarray:
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / (size - 1)
    if rng.random() < 0.5:
        angle = rng.uniform(0, 2 * math.pi)
        t = (x - 0.5) * math.cos(angle) + (y - 0.5) * math.sin(angle) + 0.5
    else:
        cx, cy = rng.uniform(0, 1, 2)
        t = np.hypot(x - cx, y - cy) / rng.uniform(0.5, 1.2)
    image = _blend(t, _colour(rng), _colour(rng))
    if rng.random() < 0.4:  # a third colour across the other direction
        image = image * (1 - 0.5 * y[..., None]) + np.asarray(_colour(rng), np.float32) * 0.5 * y[..., None]
    return image


def _photo(rng: np.random.Generator, size: int) -> np.ndarray:
    dark, light = NATURAL[rng.integers(len(NATURAL))]
    t = sum(w * _field(rng, size, cells) for w, cells in ((0.5, 3), (0.3, 7), (0.2, 17)))
    image = _blend(t, dark, light)
    if rng.random() < 0.5:  # a horizon: another region below a wavy line
        lower_dark, lower_light = NATURAL[rng.integers(len(NATURAL))]
        line = size * (rng.uniform(0.3, 0.7) + 0.08 * (_field(rng, size, 5)[0] - 0.5))
        below = (np.arange(size)[:, None] > line[None, :]).astype(np.float32)
        lower = _blend(_field(rng, size, 9), lower_dark, lower_light)
        image = image * (1 - below[..., None]) + lower * below[..., None]
    picture = Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))
    for _ in range(rng.integers(0, 4)):  # soft blobs: things out of focus
        blob = Image.new("L", (size, size), 0)
        cx, cy, r = rng.uniform(0, size, 2).tolist() + [rng.uniform(0.08, 0.3) * size]
        ImageDraw.Draw(blob).ellipse((cx - r, cy - r * rng.uniform(0.5, 1.5), cx + r, cy + r), fill=255)
        blob = blob.filter(ImageFilter.GaussianBlur(r * rng.uniform(0.3, 0.8)))
        picture = Image.composite(Image.new("RGB", (size, size), _colour(rng)), picture, blob)
    return np.asarray(picture, dtype=np.float32) + rng.normal(0, rng.uniform(2, 10), (size, size, 3))


def _strokes(rng: np.random.Generator, size: int) -> np.ndarray:
    picture = Image.new("RGB", (size, size), LIGHT[rng.integers(len(LIGHT))])
    draw = ImageDraw.Draw(picture)
    ink = _colour(rng) if rng.random() < 0.5 else (20, 20, 20)
    for _ in range(rng.integers(2, 9)):
        width = int(rng.integers(1, 4))
        kind = rng.integers(3)
        if kind == 0:  # a straight line
            draw.line(rng.uniform(0, size, 4).tolist(), fill=ink, width=width)
        elif kind == 1:  # an open arc
            x0, y0 = rng.uniform(-0.2, 0.8, 2) * size
            r = rng.uniform(0.1, 0.5) * size
            start = rng.uniform(0, 360)
            draw.arc((x0, y0, x0 + r, y0 + r), start, start + rng.uniform(40, 250), fill=ink, width=width)
        else:  # a scribble: a random walk
            points = np.cumsum(rng.normal(0, size * 0.06, (int(rng.integers(5, 20)), 2)), axis=0)
            points += rng.uniform(0.2, 0.8, 2) * size
            draw.line([tuple(p) for p in points.tolist()], fill=ink, width=width, joint="curve")
    return np.asarray(picture, dtype=np.float32)


def _stripes(rng: np.random.Generator, size: int) -> np.ndarray:
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    angle = rng.uniform(0, math.pi)
    u = x * math.cos(angle) + y * math.sin(angle)
    v = y * math.cos(angle) - x * math.sin(angle)
    wobble = rng.uniform(0, 0.08) * np.sin(2 * math.pi * rng.uniform(1, 4) * v)
    wave = np.sin(2 * math.pi * rng.uniform(2, 12) * (u + wobble))
    t = (wave > 0).astype(np.float32) if rng.random() < 0.5 else 0.5 + 0.5 * wave
    return _blend(t, _colour(rng), _colour(rng))


def _blank(rng: np.random.Generator, size: int) -> np.ndarray:
    image = np.broadcast_to(np.asarray(LIGHT[rng.integers(len(LIGHT))], np.float32), (size, size, 3))
    return image + (rng.normal(0, rng.uniform(2, 8), (size, size, 3)) if rng.random() < 0.5 else 0)


DRAW = {"blank": _blank, "noise": _noise, "gradient": _gradient, "photo": _photo, "strokes": _strokes,
        "stripes": _stripes}  # fmt: skip


def render_picture(picture: dict, size: int) -> Image.Image:
    """The picture as a size x size RGB image (the same image for the same seed)."""
    rng = np.random.default_rng(picture["seed"])
    image = DRAW[picture["family"]](rng, size)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))
