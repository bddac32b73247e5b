"""Images written inline in a prompt as HTML tags, the text-generation-webui way:
`Describe <img src="data:image/jpeg;base64,...">`."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Optional

IMG_TAG = re.compile(r"""<img\b[^>]*?\bsrc\s*=\s*(["'])(.*?)\1[^>]*>""", re.IGNORECASE | re.DOTALL)


def split_inline_images(text: str) -> list[tuple[str, str]]:
    """The prompt as ("text", str) and ("image", src) parts in order (empty text parts dropped)."""
    parts: list[tuple[str, str]] = []
    position = 0
    for match in IMG_TAG.finditer(text):
        if match.start() > position:
            parts.append(("text", text[position : match.start()]))
        parts.append(("image", match.group(2).strip()))
        position = match.end()
    if position < len(text):
        parts.append(("text", text[position:]))
    return parts


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
