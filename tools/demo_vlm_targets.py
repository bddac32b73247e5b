"""Per-patch targets of the demo VLM's vision pre-training (and the auxiliary loss of its alignment): for each
patch of a scene (``tools/demo_vlm_data.py``), the class ids of the object under it — shape, colour, size, word
or number and the character under the patch, position, centre, coordinates, counts (``TARGETS``) — and
``PatchHeads``, the throwaway linear classifiers that learn them from the vision tower's patch features."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tools import demo_vlm_data as data

PATCH_SIZE = 16
GRID = data.IMAGE_SIZE // PATCH_SIZE  # patches per side
TEXT_CLASSES = ["none", *data.WORDS, *(str(n) for n in range(100))]
CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789"  # per-patch "char" classes 1.. (0: none)
OBJECT_WEIGHT = 8.0  # an object patch's weight in the per-patch loss, against a background patch's 1
SUB = 4  # a patch is sampled at SUB x SUB points to measure how much of it an object covers
TARGETS = {  # per-patch target -> number of classes (0 is "no object" where that applies)
    "shape": len(data.SHAPES) + 2,  # 1.. shapes, last: a text
    "colour": len(data.COLOURS) + 1,
    "size": 3,
    "text": len(TEXT_CLASSES),
    "char": len(CHARACTERS) + 1,  # the letter or digit under the patch: reading starts from glyphs
    "position": len(data.POSITIONS) + 1,  # the object's left/right/top/bottom
    "anchor": 2,  # 1: the patch holds the object's centre (one token per object, for counting)
    "x": GRID + 1,  # the object's centre, in patch columns / rows (for relations)
    "y": GRID + 1,
    "x_rank": 6,  # the object's place from the left / from the top among all objects (1..5): the order of
    "y_rank": 6,  # its slot record and its row rank (tools/demo_vlm_slots.py)
    "shapes": 6,  # how many shapes the scene has (every patch)
    "same_colour": 6,  # how many shapes share the object's colour / shape / size
    "same_shape": 6,
    "same_size": 6,
}


def _covers(obj: dict, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    if "text" in obj:
        return (np.abs(x - obj["cx"]) <= obj["half_w"]) & (np.abs(y - obj["cy"]) <= obj["half_h"])
    return np.hypot(x - obj["cx"], y - obj["cy"]) <= obj["extent"] * 0.85


def _centre_cell(obj: dict) -> tuple[int, int]:
    """(row, col) of the patch holding the object's centre."""
    return min(int(obj["cy"] * GRID), GRID - 1), min(int(obj["cx"] * GRID), GRID - 1)


def char_spans(obj: dict) -> list[tuple[str, float, float]]:
    """A text object's characters with their horizontal spans (left, right) in fractions of the image width,
    as ``demo_vlm_data.render`` draws them (the ink box centred on the object's centre; each character its
    advance width)."""
    big = data.IMAGE_SIZE * data.SUPERSAMPLE
    text = obj["text"]
    font = data._font(max(1, round(obj["font"] * big)))
    left, _, right, _ = data._text_box(text, obj["font"], big)
    x0 = obj["cx"] * big - (left + right) / 2
    return [(c, (x0 + font.getlength(text[:i])) / big, (x0 + font.getlength(text[: i + 1])) / big)
            for i, c in enumerate(text)]  # fmt: skip


def _char_classes(obj: dict) -> torch.Tensor:
    """[GRID, GRID] "char" classes of a text object: per patch column, the character whose span is nearest the
    column's centre."""
    spans = char_spans(obj)
    centres = (np.arange(GRID) + 0.5) / GRID
    distance = np.array([[max(a - x, x - b, 0.0) for _, a, b in spans] for x in centres])  # [GRID, chars]
    per_column = np.array([CHARACTERS.index(c) + 1 for c, _, _ in spans])[distance.argmin(axis=1)]
    return torch.from_numpy(per_column).expand(GRID, GRID)


def patch_targets(scene: dict) -> torch.Tensor:
    """[len(TARGETS), GRID * GRID] class ids per patch (row-major) of the object that covers the patch most
    (at least 2 of its SUB x SUB sample points; the patch holding an object's centre is always that object's),
    0 where no object does; "shapes" is set everywhere. Small objects and thin text cover few patches: every
    object gets at least its centre patch."""
    offsets = (np.arange(SUB) + 0.5) / SUB
    grid = (np.arange(GRID)[:, None] + offsets[None, :]).reshape(-1) / GRID  # GRID * SUB sample coordinates
    y, x = np.meshgrid(grid, grid, indexing="ij")
    objects = scene["objects"]
    shapes = [o for o in objects if "text" not in o]
    owner = np.full((GRID, GRID), -1)
    best = np.full((GRID, GRID), 1)  # at least 2 sample points
    for i, obj in enumerate(objects):
        cover = _covers(obj, x, y).reshape(GRID, SUB, GRID, SUB).sum(axis=(1, 3))
        owner[cover > best] = i
        best = np.maximum(best, cover)
    for i, obj in enumerate(objects):  # every object owns the patch of its centre
        owner[_centre_cell(obj)] = i
    targets = torch.zeros(len(TARGETS), GRID, GRID, dtype=torch.long)
    rows = {name: i for i, name in enumerate(TARGETS)}
    targets[rows["shapes"]] = len(shapes)
    x_order, y_order = data.left_to_right(objects), data.top_to_bottom(objects)
    for i, obj in enumerate(objects):
        where = torch.from_numpy(owner == i)
        row, col = _centre_cell(obj)
        if "text" in obj:
            classes = {"shape": len(data.SHAPES) + 1, "text": TEXT_CLASSES.index(obj["text"])}
            targets[rows["char"]][where] = _char_classes(obj)[where]
        else:
            classes = {"shape": data.SHAPES.index(obj["shape"]) + 1, "size": 1 + (obj["size"] == "large"),
                       "colour": list(data.COLOURS).index(obj["colour"]) + 1,
                       "same_colour": sum(s["colour"] == obj["colour"] for s in shapes),
                       "same_shape": sum(s["shape"] == obj["shape"] for s in shapes),
                       "same_size": sum(s["size"] == obj["size"] for s in shapes)}  # fmt: skip
        position = data.POSITIONS.index(data.position_of(obj["cx"], obj["cy"])) + 1
        classes |= {"position": position, "x": col + 1, "y": row + 1,
                    "x_rank": 1 + x_order.index(i), "y_rank": 1 + y_order.index(i)}  # fmt: skip
        for name, value in classes.items():
            targets[rows[name]][where] = value
        targets[rows["anchor"], row, col] = 1
    return targets.reshape(len(TARGETS), -1)


class PatchHeads(torch.nn.Module):
    """Linear classifiers over the tower's patch features, one per TARGETS entry (dropped after training)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList(torch.nn.Linear(width, n) for n in TARGETS.values())

    def loss(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """features [B, P, width], targets [B, len(TARGETS), P] -> the mean cross-entropy over heads and patches,
        object patches weighted up (most patches are background: unweighted, the loss is low while the
        objects, what the answers are about, are still misread)."""
        weight = 1.0 + (OBJECT_WEIGHT - 1.0) * (targets[:, 0] > 0).flatten().float()
        total = 0.0
        for i, head in enumerate(self.heads):
            losses = F.cross_entropy(head(features.float()).flatten(0, 1), targets[:, i].flatten(), reduction="none")
            total = total + (losses * weight).sum() / weight.sum()
        return total / len(self.heads)
