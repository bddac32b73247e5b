"""Decoding untrusted image bytes into an RGB image.

The size checks (pixels, aspect ratio, smallest side) read the dimensions from the header, before
a single pixel is decoded, so a 1x60000 image or a decompression bomb is refused without the
memory or time its decoding would take. Then, as HF transformers' `load_image` does, the EXIF
orientation is applied and the image converted to RGB, except that 16-bit and float images are
scaled onto 0..255 instead of clipped there.
"""

from __future__ import annotations

import io
import logging
import threading
import warnings
from typing import Optional

import numpy as np
from PIL import Image, ImageOps

from ..errors import InputError, InputTooLargeError
from .media_policy import MediaPolicy

logger = logging.getLogger(__name__)

FORMAT_NAMES = {"JPEG": "JPEG", "PNG": "PNG", "WEBP": "WebP", "GIF": "GIF", "BMP": "BMP"}

# Image.open reports images over PIL's own pixel limit with a warning, and the warnings filters are
# process-wide, so the opens that silence it (the policy's max_pixels decides) take turns. Opening
# reads the header only; decoding happens outside the lock.
_open_lock = threading.Lock()


def default_policy() -> MediaPolicy:
    return MediaPolicy()


def check_size(width: int, height: int, policy: MediaPolicy) -> None:
    """Refuse an image too small for the image processors, with too many pixels (413), or too
    elongated."""
    size = f"The image is {width}x{height} pixels"
    if width * height > policy.max_pixels:
        raise InputTooLargeError(f"{size}, over the limit of {policy.max_pixels} pixels.")
    if min(width, height) >= 1 and max(width, height) / min(width, height) > policy.max_aspect_ratio:
        raise InputError(f"{size}, an aspect ratio over the limit of {policy.max_aspect_ratio:g} to 1.")
    if min(width, height) < policy.min_side:
        raise InputError(f"{size}; images must be at least {policy.min_side} pixels on each side.")


def check_image(image: Image.Image, policy: Optional[MediaPolicy] = None) -> None:
    """The size checks of decode_image, for an image the caller decoded (the offline API)."""
    if not isinstance(image, Image.Image):
        raise InputError(f"Expected a PIL image, not {type(image).__name__}.")
    check_size(*image.size, policy or default_policy())


def decode_failed(policy: MediaPolicy, error: BaseException) -> InputError:
    logger.info("An image could not be decoded: %s: %s", type(error).__name__, error)
    formats = policy.image_formats
    names = [FORMAT_NAMES[f] for f in formats if f in FORMAT_NAMES] if formats else []
    kinds = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    kinds = f"a {kinds}" if kinds else "an"
    return InputError(f"The image could not be decoded: it is corrupt, truncated, or not {kinds} image.")


def decode_image(data: bytes, policy: Optional[MediaPolicy] = None) -> Image.Image:
    """The RGB image encoded in `data` (CPU work: up to a second for the largest allowed images).
    Its first frame if animated. InputError if it is not an image of an allowed format, or too
    small or elongated; InputTooLargeError if it has too many pixels."""
    policy = policy or default_policy()
    formats = list(policy.image_formats) if policy.image_formats is not None else None
    try:
        with _open_lock, warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=formats)  # reads the header only
    except Image.DecompressionBombError as e:  # over twice PIL's limit: refused before our check
        logger.info("A decompression bomb was refused: %s", e)
        raise InputTooLargeError(f"The image is over the limit of {policy.max_pixels} pixels.") from None
    except Exception as e:  # hostile bytes make plugins fail in many ways; none is the server's fault
        raise decode_failed(policy, e) from None
    check_size(*image.size, policy)
    try:
        image.load()
    except Exception as e:
        raise decode_failed(policy, e) from None
    try:
        ImageOps.exif_transpose(image, in_place=True)
    except Exception as e:  # a broken EXIF block: the pixels are still good
        logger.info("An image's EXIF orientation was ignored: %s: %s", type(e).__name__, e)
    rgb = to_rgb(image)
    rgb.format = image.format
    return rgb


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB: `convert("RGB")` (as HF's load_image), except that 16-bit images ("I;16*",
    and "I", which PIL makes from 16-bit files) are scaled from 0..65535 and float images ("F")
    from 0..1, where convert would clip them at 255."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode == "I" or mode.startswith("I;16"):
        values = np.clip(np.asarray(image).astype(np.int64), 0, 65535)
        gray = ((values * 255 + 32767) // 65535).astype(np.uint8)  # round(v / 257): v * 257 undone
    elif mode == "F":
        values = np.nan_to_num(np.asarray(image).astype(np.float32), nan=0.0)
        gray = np.round(np.clip(values, 0.0, 1.0) * 255).astype(np.uint8)
    else:
        try:
            return image.convert("RGB")
        except ValueError as e:
            logger.info("An image in mode %s could not be converted to RGB: %s", mode, e)
            raise InputError(f"Images in color mode {mode!r} are not supported; send an RGB image.") from None
    return Image.fromarray(gray).convert("RGB")
