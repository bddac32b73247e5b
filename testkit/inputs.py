"""Inputs shared by tests and benchmarks: seeded random images and videos, hand-built PNGs, LLaVA prompts."""

from __future__ import annotations

import base64
import functools
import io
import struct
import zlib

import numpy as np
from PIL import Image

LLAVA_PROMPTS = {
    0: "USER: What is in the picture? ASSISTANT:",
    1: "USER: <image>\nWhat colour is the circle? ASSISTANT:",
    3: "USER: <image>\n<image> and <image>\nCompare them. ASSISTANT:",
}
"""LLaVA-1.5 prompts by number of images."""

IMAGE_SIZES = [(60, 40), (32, 32), (50, 100)]  # (width, height)


def random_images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    """RGB noise images of the given (width, height) sizes, the same for the same seed."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def random_video(num_frames: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """RGB noise frames, uint8 [num_frames, height, width, 3], the same for the same seed."""
    return np.random.default_rng(seed).integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)


@functools.cache
def png_bytes(width: int, height: int) -> bytes:
    """A valid 1-bit greyscale PNG of width x height, built by hand: a huge one costs little to
    make (its rows compress to almost nothing) and a lot to decode."""
    compressor, row = zlib.compressobj(9), b"\0" * (1 + -(-width // 8))  # filter byte + packed bits
    pixels = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def image_data_url(image: Image.Image) -> str:
    """`image` as a PNG data URL, as clients send an image in a chat part."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
