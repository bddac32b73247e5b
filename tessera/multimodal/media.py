"""Loading images from what users send: data URLs, base64 strings and local files."""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.request
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


def fetch_url(url: str, *, max_bytes: int, timeout: float) -> bytes:
    """The body at an http(s) URL, refusing more than max_bytes or a wait over timeout seconds."""
    request = urllib.request.Request(url, headers={"User-Agent": "tessera"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise ValueError(f"The image at {url} is {int(length)} bytes, over the limit of {max_bytes}.")
            data = response.read(max_bytes + 1)
    except urllib.error.HTTPError as e:
        raise ValueError(f"Fetching the image at {url} failed: HTTP {e.code}.") from e
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ValueError(f"Fetching the image at {url} failed: {reason}.") from e
    if len(data) > max_bytes:
        raise ValueError(f"The image at {url} is over the limit of {max_bytes} bytes.")
    return data


def load_image_url(
    url: str,
    *,
    allowed_local_dir: Optional[str | Path] = None,
    allow_any_local: bool = False,
    fetch_http: bool = False,
    max_bytes: int = 20 * 2**20,
    timeout: float = 10.0,
) -> Image.Image:
    """An image from a `data:image/...;base64,` URL, a `file://` URL, a local path, or with
    `fetch_http` an http(s) URL (at most max_bytes, within timeout seconds).

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
        if not fetch_http:
            raise ValueError("http(s) image URLs are not fetched here; send a data URL or a local file path.")
        return load_image_bytes(fetch_url(url, max_bytes=max_bytes, timeout=timeout), f"image at {url}")
    if parsed.scheme not in ("", "file") and len(parsed.scheme) > 1:  # (a one-letter scheme is a Windows drive)
        raise ValueError(f"Unsupported image URL scheme {parsed.scheme!r}; send a data URL, http(s) or a file.")
    path = Path(unquote(parsed.path) if parsed.scheme == "file" else url).expanduser().resolve()
    if not allow_any_local:
        if allowed_local_dir is None or not path.is_relative_to(Path(allowed_local_dir).resolve()):
            raise ValueError(f"Local file {path} is not inside the allowed media folder.")
    if not path.is_file():
        raise ValueError(f"Image file {path} does not exist.")
    return load_image_bytes(path.read_bytes(), f"file {path}")
