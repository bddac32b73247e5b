"""The prompts `tessera bench serve` sends: random-noise images with short questions (`--dataset random-mm`,
the same for a seed), or a JSONL file of {"prompt", "image" (URL or path), "max_tokens"} lines, its local
images sent as data: URLs."""

from __future__ import annotations

import base64
import io
import json
import mimetypes
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

QUESTIONS = (
    "What is in this image?",
    "Describe the image in one sentence.",
    "What colours do you see?",
    "Is there any text in this picture?",
    "What shapes are in the image?",
    "Describe the texture of this image.",
    "What is the main colour of the image?",
    "Count the objects in the image.",
)


@dataclass
class BenchPrompt:
    text: str
    image_url: Optional[str]  # an http(s) or data: URL
    max_tokens: int


def random_mm_prompts(num: int, sizes: list[tuple[int, int]], max_tokens: int, seed: int = 0) -> list[BenchPrompt]:
    """`num` prompts of a random-noise JPEG (sizes cycled) and a short question, the same for a seed."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(num):
        width, height = sizes[i % len(sizes)]
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=85)
        url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
        prompts.append(BenchPrompt(QUESTIONS[int(rng.integers(len(QUESTIONS)))], url, max_tokens))
    return prompts


def jsonl_prompts(path: str, num: int, max_tokens: int) -> list[BenchPrompt]:
    """The file's prompts (cycled up to `num`); a local image becomes a data: URL, relative to the file."""
    base = Path(path).parent
    lines = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e})") from None
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise ValueError(f'{path}:{number}: needs {{"prompt": "..."}}')
            image = item.get("image")
            lines.append(BenchPrompt(item["prompt"], _image_url(image, base) if image else None,
                                     int(item.get("max_tokens") or max_tokens)))  # fmt: skip
    if not lines:
        raise ValueError(f"{path} has no prompts")
    return [lines[i % len(lines)] for i in range(num)]


def _image_url(image: str, base: Path) -> str:
    if image.startswith(("http://", "https://", "data:")):
        return image
    path = Path(image.removeprefix("file://"))
    path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise ValueError(f"image {image} not found")
    mime = mimetypes.guess_type(path.name)[0] or "image/png"
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()
