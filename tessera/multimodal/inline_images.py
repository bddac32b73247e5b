"""Images written inline in a prompt as HTML tags, the text-generation-webui way:
`Describe <img src="data:image/jpeg;base64,...">`."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Optional

_IMG_OPEN = re.compile(r"<img\b", re.IGNORECASE)
_SRC = re.compile(r"""\bsrc\s*=\s*(?:"([^"]*)"|'([^']*)')""", re.IGNORECASE)


def split_inline_images(text: str) -> list[tuple[str, str]]:
    """The prompt as ("text", str) and ("image", src) parts in order (empty text parts dropped).

    A tag runs from `<img` to the next `>`; its src is looked for inside it only. Tags never
    overlap, so the scan is linear however hostile the text (a regex over the whole prompt can
    backtrack quadratically on many unterminated tags)."""
    parts: list[tuple[str, str]] = []
    position = search_from = 0
    while (opening := _IMG_OPEN.search(text, search_from)) is not None:
        close = text.find(">", opening.end())
        if close == -1:
            break
        src = _SRC.search(text, opening.end(), close)
        search_from = close + 1
        if src is None:
            continue  # an <img> without a src stays text
        if opening.start() > position:
            parts.append(("text", text[position : opening.start()]))
        parts.append(("image", (src.group(1) if src.group(1) is not None else src.group(2)).strip()))
        position = close + 1
    if position < len(text):
        parts.append(("text", text[position:]))
    return parts


def count_inline_images(text: str) -> int:
    return sum(kind == "image" for kind, _ in split_inline_images(text))


def inline_images_to_prompt(
    text: str, placeholder: Optional[Callable[[int], Optional[str]]], load_image: Callable[[str], Any]
) -> dict:
    """An engine prompt: each tag replaced by the model's placeholder for image i (or removed where
    the model places images itself), the images loaded in order."""
    pieces, images = [], []
    for kind, value in split_inline_images(text):
        if kind == "text":
            pieces.append(value)
            continue
        pieces.append((placeholder(len(images)) if placeholder else None) or "")
        images.append(load_image(value))
    prompt = "".join(pieces)
    return {"prompt": prompt, "multi_modal_data": {"image": images}} if images else {"prompt": prompt}
