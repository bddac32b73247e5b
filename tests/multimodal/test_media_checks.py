"""Unit tests for tessera.multimodal.media_checks: the user's images and videos in every form taken, and what is
refused (the parser's view of them: tests/multimodal/test_parse.py, test_video.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tessera.errors import InputError
from tessera.multimodal.media_checks import (
    MIN_IMAGE_SIDE,
    ImageSize,
    as_image_list,
    as_videos,
    image_size_of,
    is_frame_list,
)
from tessera.multimodal.video import VideoFrames

T, H, W = 3, 6, 5  # distinct, so that a swapped axis shows


def test_image_size_of_reads_each_layout_as_width_and_height():
    assert image_size_of(Image.new("RGB", (W, H))) == ImageSize(W, H)
    assert image_size_of(np.zeros((H, W, 3), np.uint8)) == ImageSize(W, H)  # HWC
    assert image_size_of(torch.zeros(3, H, W)) == ImageSize(W, H)  # CHW


def test_a_batch_array_is_one_image_per_row_and_one_image_is_a_list_of_one():
    batch = np.zeros((2, H, W, 3), np.uint8)
    assert [image.shape for image in as_image_list(batch)] == [(H, W, 3)] * 2
    (one,) = as_image_list(Image.new("RGB", (W, H)))
    assert one.size == (W, H)


def test_an_image_under_the_processors_minimum_is_refused_naming_its_size():
    with pytest.raises(InputError, match=f"Image 1 is {W}x2 pixels.*at least {MIN_IMAGE_SIDE}"):
        as_image_list([Image.new("RGB", (W, H)), Image.new("RGB", (W, 2))])


def test_a_list_of_frames_is_one_video_and_a_list_of_arrays_of_frames_is_several():
    frames = [np.full((H, W, 3), t, np.uint8) for t in range(T)]
    assert is_frame_list(frames) and not is_frame_list([np.stack(frames)] * 2) and not is_frame_list([])
    (video,), metadata, tracks = as_videos(frames)
    assert video.shape == (T, H, W, 3) and video[:, 0, 0, 0].tolist() == list(range(T))
    assert metadata == [None] and tracks == [None]
    videos, _, _ = as_videos([np.stack(frames)] * 2)
    assert [v.shape for v in videos] == [(T, H, W, 3)] * 2


def test_decoded_video_frames_keep_their_metadata_and_sound_track():
    sound = (np.zeros(160, np.float32), 16000)
    decoded = VideoFrames(np.zeros((T, H, W, 3), np.uint8), fps=2.0, duration=1.5, total_num_frames=T,
                          frames_indices=tuple(range(T)), audio=sound)  # fmt: skip
    (video,), (metadata,), (track,) = as_videos(decoded)
    assert video.shape == (T, H, W, 3) and metadata == decoded.metadata and track is sound


@pytest.mark.parametrize(
    "video, message",
    [
        ([np.zeros((H, W, 3), np.uint8), np.zeros((H + 1, W, 3), np.uint8)], "frames of different sizes"),
        (np.zeros((T, H, W, 3), np.float32), "expected a uint8 \\[T, H, W, 3\\] RGB array"),
        (np.zeros((0, H, W, 3), np.uint8), "has no frames"),
        (np.zeros((T, 2, W, 3), np.uint8), f"at least {MIN_IMAGE_SIDE} pixels"),
        ("clip.mp4", "unsupported type str"),
    ],
)
def test_a_bad_video_is_refused_naming_what_is_wrong(video, message):
    with pytest.raises(InputError, match=message):
        as_videos([video] if isinstance(video, np.ndarray) else video)
