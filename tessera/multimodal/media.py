"""Loading images from what users send: data URLs, local files and http(s) URLs, under a policy.

`read_media_bytes` is the IO part (it blocks on the network for http(s) URLs, up to
`MediaPolicy.timeout` in all), `decode_image` the CPU part; `load_image_url` is both. The fetch
itself (addresses vetted, redirects re-checked, one total deadline) is in media_fetch.py, the
header checks and decoding in image_decode.py.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import stat
import string
from pathlib import Path
from typing import Any, Optional
from urllib.parse import unquote, urlsplit

from PIL import Image

from ..errors import InputError, InputTooLargeError
from .image_decode import check_image, decode_image
from .media_fetch import fetch_url
from .media_policy import MediaPolicy

__all__ = [
    "IMAGE_MIME_TYPES",
    "LOCAL_FILES",
    "MediaPolicy",
    "check_image",
    "decode_image",
    "is_http_url",
    "load_image_url",
    "read_media_bytes",
]

IMAGE_MIME_TYPES = ("image/jpeg", "image/png", "image/webp", "image/gif", "image/bmp")
MAX_URL_CHARS = 8192  # for http(s) URLs and paths; data URLs are limited by max_bytes
ASCII_WHITESPACE = b" \t\n\r\x0b\x0c"
CONTROL_OR_SPACE = "".join(map(chr, range(33)))
SCHEME_CHARS = frozenset(string.ascii_letters + string.digits + "+-.")


# For callers who own the machine (the offline API, the CLI): any local file in any format PIL
# reads; no network. The size checks stay: they spare the HF processor images it cannot handle.
LOCAL_FILES = MediaPolicy(allow_any_local=True, image_formats=None)


def url_scheme(url: str) -> str:
    """The scheme of `url` in lower case, "" if none, read as urlsplit reads it (leading control
    characters and spaces skipped, tabs and newlines ignored) but without judging the rest."""
    head = url[:64].lstrip(CONTROL_OR_SPACE).replace("\t", "").replace("\r", "").replace("\n", "")
    scheme, colon, _ = head.partition(":")
    if not colon or scheme[:1] not in string.ascii_letters or not set(scheme) <= SCHEME_CHARS:
        return ""
    return scheme.lower()


def is_http_url(url: str) -> bool:
    """Whether `url` is fetched over the network (read_media_bytes then blocks up to the timeout)."""
    return url_scheme(url) in ("http", "https")


def too_large(max_bytes: int) -> InputTooLargeError:
    return InputTooLargeError(f"The image is over the size limit of {max_bytes} bytes.")


def read_media_bytes(url: str, policy: MediaPolicy) -> bytes:
    """The bytes of the image at `url`: a `data:image/...;base64,` URL, a `file://` URL or local
    path (under the policy's local-file rules), or an http(s) URL (if the policy fetches them).

    Every failure is an InputError (InputTooLargeError over max_bytes) with a message fit for the
    client; fetch failures all share one message (the reason goes to media_fetch's log)."""
    if url[:5].lower() == "data:":
        return read_data_url(url, policy.max_bytes)
    if is_http_url(url):
        if not policy.fetch_urls:
            raise InputError("http(s) image URLs are not fetched here; send a data URL instead.")
        if len(url) > MAX_URL_CHARS:
            raise InputError(f"The image URL is over {MAX_URL_CHARS} characters long.")
        return fetch_url(url, policy)
    scheme = url_scheme(url)
    if scheme not in ("", "file") and len(scheme) > 1:  # (a one-letter scheme is a Windows drive)
        raise InputError(f"Unsupported image URL scheme {scheme[:20]!r}; send a data URL, http(s) or a file.")
    return read_local_file(url, scheme == "file", policy)


def read_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a base64 data URL; line-wrapped base64 is fine, anything else not base64 is not."""
    header, _, payload = url.partition(",")
    params = [p.strip().lower() for p in header[5:].split(";")]
    if params[0] not in IMAGE_MIME_TYPES:
        shown = repr(params[0][:40]) if params[0] else "none"
        raise InputError(f"Unsupported media type {shown}; send one of {', '.join(IMAGE_MIME_TYPES)}.")
    if "base64" not in params[1:]:
        raise InputError("Image data URLs must be base64-encoded (data:image/png;base64,...).")
    # The size the payload decodes to, from its length (4 characters carry 3 bytes), before any copy.
    chars = len(payload) - sum(payload.count(c) for c in ASCII_WHITESPACE.decode())
    if chars // 4 * 3 - 2 > max_bytes:
        raise too_large(max_bytes)
    try:
        compact = b"".join(payload.encode("ascii").split())  # bytes.split() splits on ASCII whitespace only
        data = base64.b64decode(compact, validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError) as e:
        raise InputError("The image data URL is not valid base64.") from e
    if len(data) > max_bytes:
        raise too_large(max_bytes)
    return data


def read_local_file(url: str, is_file_url: bool, policy: MediaPolicy) -> bytes:
    """The bytes of a local file: a regular file, inside the allowed folder unless any is allowed.

    Messages never show the resolved path; with allow_any_local (the caller owns the files) they
    repeat the path as given."""
    if not policy.allow_any_local and policy.allowed_local_dir is None:
        raise InputError("Local image files are not read here; send a data URL instead.")
    try:
        given = unquote(urlsplit(url).path) if is_file_url else url
    except ValueError as e:
        raise InputError("The image file URL is not valid.") from e
    named = f"Image file {given[:300]}" if policy.allow_any_local else "The image file"
    if len(given) > MAX_URL_CHARS:
        raise InputError("The image file path is too long.")
    try:
        path = Path(given).expanduser().resolve()
    except (OSError, ValueError, RuntimeError) as e:
        raise InputError(f"{named} is not a valid path.") from e
    if not policy.allow_any_local and not path.is_relative_to(Path(policy.allowed_local_dir).resolve()):
        raise InputError("The local file is not inside the allowed media folder.")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)  # O_NONBLOCK: a FIFO must not hang us; O_NOFOLLOW: resolved above
    except FileNotFoundError as e:
        raise InputError(f"{named} does not exist.") from e
    except IsADirectoryError as e:
        raise InputError(f"{named} is a folder, not a file.") from e
    except (OSError, ValueError) as e:
        raise InputError(f"{named} could not be read.") from e
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise InputError(f"{named} is a folder, not a file.")
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"{named} is not a regular file.")
        if info.st_size > policy.max_bytes:
            raise too_large(policy.max_bytes)
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(policy.max_bytes + 1)
    except OSError as e:
        raise InputError(f"{named} could not be read.") from e
    finally:
        os.close(fd)
    if len(data) > policy.max_bytes:  # it grew since fstat
        raise too_large(policy.max_bytes)
    return data


LEGACY_NAMES = {"fetch_http": "fetch_urls"}


def load_image_url(url: str, policy: Optional[MediaPolicy] = None, **overrides: Any) -> Image.Image:
    """The RGB image at `url` (see read_media_bytes), checked and decoded under `policy`.

    Keyword overrides replace policy fields: `load_image_url(url, allow_any_local=True)`
    (`fetch_http=` is the old name of `fetch_urls=`)."""
    policy = policy or MediaPolicy()
    if overrides:
        policy = dataclasses.replace(policy, **{LEGACY_NAMES.get(k, k): v for k, v in overrides.items()})
    return decode_image(read_media_bytes(url, policy), policy)
