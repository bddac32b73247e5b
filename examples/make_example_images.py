"""Draw the example images in this folder (scenes like the demo model's training set, at 256x256).

python -m examples.make_example_images   # rewrites examples/*.png

Each scene is given explicitly, so the right answers to every question follow from SCENES (the tests ask the
bundled model about these images and derive the expected answers from here, through tools/tiny_demo_data.py).
"""

from __future__ import annotations

import random
from pathlib import Path

from tools import tiny_demo_data

HERE = Path(__file__).resolve().parent

SIZE = 256
# Centres and half-sizes are fractions of the image size; each respects tiny_demo_data's margins (checked below).
SCENES = {
    "three_shapes.png": [
        {"shape": "circle", "colour": "red", "cx": 0.2, "cy": 0.55, "half": 0.12},
        {"shape": "square", "colour": "blue", "cx": 0.52, "cy": 0.2, "half": 0.12},
        {"shape": "triangle", "colour": "green", "cx": 0.78, "cy": 0.62, "half": 0.13},
    ],
    "two_shapes.png": [
        {"shape": "triangle", "colour": "orange", "cx": 0.42, "cy": 0.78, "half": 0.14},
        {"shape": "circle", "colour": "purple", "cx": 0.8, "cy": 0.42, "half": 0.13},
    ],
    "one_shape.png": [{"shape": "square", "colour": "yellow", "cx": 0.25, "cy": 0.45, "half": 0.14}],
}


def main() -> None:
    for name, shapes in SCENES.items():
        for s in shapes:
            dx, dy = abs(s["cx"] - 0.5), abs(s["cy"] - 0.5)
            assert abs(dx - dy) >= tiny_demo_data.POSITION_MARGIN, (name, s)
            assert max(dx, dy) >= tiny_demo_data.MIN_OFFSET, (name, s)
        tiny_demo_data.render(random.Random(name), shapes, SIZE).save(HERE / name, optimize=True)
        print(f"{name}: {tiny_demo_data.describe(shapes)}")


if __name__ == "__main__":
    main()
