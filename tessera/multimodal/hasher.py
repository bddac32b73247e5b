"""Content hashes of multimodal items: equal pixels (and kwargs) give equal hashes.

Used as keys of the processor-output cache and of prefix-cache blocks, so every value that
changes the processed output must enter the hash: the image's mode, shape, dtype and bytes, the
model, and the processor kwargs. An in-memory image whose EXIF ImageID holds a `uuid.UUID` is
hashed by that id instead of its pixels (as vLLM does).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable, Mapping
from typing import Optional

import numpy as np
import torch
from blake3 import blake3
from PIL import Image


class MultiModalHasher:
    @classmethod
    def hash_kwargs(cls, **kwargs: object) -> str:
        """Hash keyword values; key order does not matter."""
        hasher = blake3()
        for key in sorted(kwargs):
            hasher.update(key.encode())
            for chunk in cls._serialize(kwargs[key]):
                hasher.update(chunk)
        return hasher.hexdigest()

    @classmethod
    def _serialize(cls, obj: object) -> Iterable[bytes | memoryview]:
        # Each value is prefixed by its kind so that, e.g., the string "1" and the int 1 differ.
        if isinstance(obj, Image.Image):
            image_id = _exif_image_id(obj)
            if image_id is not None:  # the caller named this image: its id stands for its pixels
                yield b"<image-id>" + image_id.bytes
                return
            yield f"<image {obj.mode} {obj.size}>".encode()
            if obj.palette is not None:  # palette images: equal indices with other colours differ
                yield from cls._serialize(obj.getpalette())
            yield obj.tobytes()
        elif isinstance(obj, torch.Tensor):
            tensor = obj.detach().cpu().contiguous()
            yield f"<tensor {tensor.dtype} {tuple(tensor.shape)}>".encode()
            # view as bytes so dtypes numpy lacks (bfloat16) hash too
            yield memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else b""
        elif isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:  # raw bytes would be pointers, not values
                raise TypeError("Cannot hash a numpy array of Python objects for the multimodal cache")
            array = np.ascontiguousarray(obj)
            yield f"<ndarray {array.dtype.str} {array.shape}>".encode()
            yield memoryview(array).cast("B") if array.size else b""
        elif isinstance(obj, Mapping):
            yield f"<dict {len(obj)}>".encode()
            for key in sorted(obj, key=repr):
                yield from cls._serialize(key)
                yield from cls._serialize(obj[key])
        elif isinstance(obj, (list, tuple)):
            yield f"<{type(obj).__name__} {len(obj)}>".encode()
            for item in obj:
                yield from cls._serialize(item)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # e.g. transformers' SizeDict
            yield f"<{type(obj).__name__}>".encode()
            yield from cls._serialize({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
        elif isinstance(obj, np.generic):
            yield from cls._serialize(obj.item())
        elif obj is None or isinstance(obj, (bool, int, float, str, bytes)):
            yield f"<{type(obj).__name__} {obj!r}>".encode()
        else:
            raise TypeError(f"Cannot hash a {type(obj).__name__} for the multimodal cache")


def _exif_image_id(image: Image.Image) -> Optional[uuid.UUID]:
    """A `uuid.UUID` stored in the image's EXIF ImageID tag (vLLM's way to name an in-memory image).
    Only code can put a UUID object there: a decoded file's tag is a string and is ignored, so a
    client cannot choose the cache key of an image it uploads."""
    try:
        value = image.getexif().get(Image.ExifTags.Base.ImageID)
    except Exception:  # malformed EXIF: hash the pixels
        return None
    return value if isinstance(value, uuid.UUID) else None
