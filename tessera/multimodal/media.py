"""Loading images from what users send: data URLs, base64 strings and local files."""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

IMAGE_MIME_TYPES = ("image/jpeg", "image/png", "image/webp", "image/gif", "image/bmp")


def load_image_bytes(data: bytes, where: str = "image") -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ValueError(f"The {where} could not be decoded as an image ({e}).") from e
    return image


def load_image_url(
    url: str, *, allowed_local_dir: Optional[str | Path] = None, allow_any_local: bool = False
) -> Image.Image:
    """An image from a `data:image/...;base64,` URL, a `file://` URL or a local path.

    Local files are read only inside `allowed_local_dir`, or anywhere with `allow_any_local`
    (the offline API, whose caller owns the files)."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        mime = header[5:].split(";")[0].lower()
        if mime not in IMAGE_MIME_TYPES:
            raise ValueError(f"Unsupported media type {mime or 'none'!r}; send one of {', '.join(IMAGE_MIME_TYPES)}.")
        if ";base64" not in header:
            raise ValueError("Image data URLs must be base64-encoded (data:image/png;base64,...).")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"The image data URL is not valid base64 ({e}).") from e
        return load_image_bytes(data, "data URL")
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        raise ValueError("http(s) image URLs are not fetched here; send a data URL or a local file path.")
    path = Path(unquote(parsed.path) if parsed.scheme == "file" else url).expanduser().resolve()
    if not allow_any_local:
        if allowed_local_dir is None or not path.is_relative_to(Path(allowed_local_dir).resolve()):
            raise ValueError(f"Local file {path} is not inside the allowed media folder.")
    if not path.is_file():
        raise ValueError(f"Image file {path} does not exist.")
    return load_image_bytes(path.read_bytes(), f"file {path}")
