"""The user's images and videos checked before any processor sees them: their types, shapes and sizes, each
error naming the item and the forms that are taken (``parse.MultiModalDataParser`` calls these)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import numpy as np
import torch
from PIL import Image

from ..errors import InputError
from .inputs import ImageItem
from .media import MediaPolicy
from .video import VideoFrames


class ImageSize(NamedTuple):
    width: int
    height: int


def image_size_of(image: ImageItem) -> ImageSize:
    if isinstance(image, Image.Image):
        return ImageSize(*image.size)
    if isinstance(image, np.ndarray):  # HWC
        return ImageSize(width=image.shape[1], height=image.shape[0])
    return ImageSize(width=image.shape[-1], height=image.shape[-2])  # CHW tensor


def as_image_list(data: Any) -> list[ImageItem]:
    if isinstance(data, np.ndarray) and data.ndim == 4:
        data = list(data)
    elif isinstance(data, torch.Tensor) and data.ndim == 4:
        data = list(data.unbind(0))
    elif not isinstance(data, (list, tuple)):
        data = [data]
    return [_check_image(image, i) for i, image in enumerate(data)]


# HF image processors guess the channel axis of an image from its shape, and guess wrong for
# fewer than 4 rows (see tests/multimodal/test_image_decode.py); the server's limit as well.
MIN_IMAGE_SIDE = MediaPolicy().min_side


def _check_image(image: Any, index: int) -> ImageItem:
    image = _check_image_type(image, index)
    width, height = image_size_of(image)
    if min(width, height) < MIN_IMAGE_SIDE:
        raise InputError(
            f"Image {index} is {width}x{height} pixels; images must be at least {MIN_IMAGE_SIDE} pixels on each side."
        )
    return image


def _check_image_type(image: Any, index: int) -> ImageItem:
    where = f"Image {index}"
    if isinstance(image, Image.Image):
        try:
            image.load()  # decode now, so a truncated file fails here with a clear message
        except Exception as e:
            raise ValueError(f"{where} could not be decoded ({e}); pass a complete, valid image file.") from e
        return image
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] not in (1, 3, 4) or image.dtype != np.uint8:
            raise ValueError(
                f"{where} is a numpy array of shape {image.shape} and dtype {image.dtype}; "
                "expected an HWC uint8 array with 1, 3 or 4 channels."
            )
        return image
    if isinstance(image, torch.Tensor):
        if image.ndim != 3 or image.shape[0] not in (1, 3, 4):
            raise ValueError(
                f"{where} is a tensor of shape {tuple(image.shape)}; expected a CHW tensor with 1, 3 or 4 "
                "channels (pass precomputed embeddings under 'image_embeds')."
            )
        return image
    raise ValueError(
        f"{where} has unsupported type {type(image).__name__}; pass a PIL.Image.Image, an HWC uint8 "
        "numpy array or a CHW torch tensor."
    )


VIDEO_FORMS = (
    "a uint8 [T, H, W, 3] numpy array, a list of PIL images, a list of HWC uint8 numpy arrays or a "
    "VideoFrames (tessera.multimodal.video.decode_video), or a list of such videos"
)


def is_frame_list(data: Any) -> bool:
    """A list of frames (one video), as opposed to a list of videos."""
    return (
        isinstance(data, (list, tuple))
        and len(data) > 0
        and all(isinstance(f, Image.Image) or (isinstance(f, np.ndarray) and f.ndim == 3) for f in data)
    )


def as_videos(data: Any) -> tuple[list[np.ndarray], list[Optional[dict]], list[Any]]:
    """One video or a list of them -> (frames [T, H, W, 3] uint8 each, their metadata, their audio tracks)."""
    if isinstance(data, (np.ndarray, VideoFrames)) or is_frame_list(data):
        data = [data]
    elif not isinstance(data, (list, tuple)):
        raise InputError(f"multi_modal_data['video'] has unsupported type {type(data).__name__}; pass {VIDEO_FORMS}.")
    videos, metadata, tracks = [], [], []
    for index, video in enumerate(data):
        meta, track = None, None
        if isinstance(video, VideoFrames):
            video, meta, track = video.frames, video.metadata, video.audio
        videos.append(_check_video(video, index))
        metadata.append(meta)
        tracks.append(track)
    return videos, metadata, tracks


def _check_video(video: Any, index: int) -> np.ndarray:
    where = f"Video {index}"
    if is_frame_list(video):
        frames = [_check_frame(frame, where, i) for i, frame in enumerate(video)]
        sizes = {f.shape for f in frames}
        if len(sizes) > 1:
            raise InputError(
                f"{where} has frames of different sizes {sorted(sizes)}; all frames of a video must match."
            )
        video = np.stack(frames)
    if not isinstance(video, np.ndarray):
        raise InputError(f"{where} has unsupported type {type(video).__name__}; pass {VIDEO_FORMS}.")
    if video.ndim != 4 or video.shape[3] != 3 or video.dtype != np.uint8:
        raise InputError(
            f"{where} is a numpy array of shape {video.shape} and dtype {video.dtype}; "
            "expected a uint8 [T, H, W, 3] RGB array."
        )
    if video.shape[0] == 0:
        raise InputError(f"{where} has no frames.")
    height, width = video.shape[1:3]
    if min(width, height) < MIN_IMAGE_SIDE:
        raise InputError(
            f"{where} has frames of {width}x{height} pixels; frames must be at least {MIN_IMAGE_SIDE} pixels "
            "on each side."
        )
    return video


def _check_frame(frame: Union[Image.Image, np.ndarray], where: str, index: int) -> np.ndarray:
    if isinstance(frame, Image.Image):
        try:
            return np.asarray(frame.convert("RGB"))
        except Exception as e:
            raise InputError(f"{where}, frame {index} could not be decoded ({e}); pass complete, valid images.") from e
    if frame.shape[2:] != (3,) or frame.dtype != np.uint8:
        raise InputError(
            f"{where}, frame {index} is a numpy array of shape {frame.shape} and dtype {frame.dtype}; "
            "expected an HWC uint8 RGB array."
        )
    return frame
