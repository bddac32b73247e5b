"""Short test videos written with PyAV: a coloured top half that cycles through VIDEO_COLORS, and
a white square that moves right on a black bottom half, so every frame shows its index."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Optional, Union

import numpy as np

VIDEO_COLORS = ((255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0))
"""The top half's colour of frame i is VIDEO_COLORS[i % 4]."""
SQUARE_SIDE = 8
SQUARE_STEP = 3
"""The white square of frame i spans columns [i * SQUARE_STEP, i * SQUARE_STEP + SQUARE_SIDE) of the bottom half."""


def video_frame(index: int, width: int = 64, height: int = 48) -> np.ndarray:
    """Frame `index` of the test video as drawn: uint8 [height, width, 3]."""
    frame = np.zeros((height, width, 3), dtype=np.uint8)
    frame[: height // 2] = VIDEO_COLORS[index % len(VIDEO_COLORS)]
    left = (index * SQUARE_STEP) % max(1, width - SQUARE_SIDE)
    top = height // 2 + (height // 2 - SQUARE_SIDE) // 2
    frame[top : top + SQUARE_SIDE, left : left + SQUARE_SIDE] = 255
    return frame


def video_bytes(
    num_frames: int = 16,
    width: int = 64,
    height: int = 48,
    fps: int = 8,
    *,
    codec: str = "mpeg4",
    container: str = "mp4",
    path: Optional[Union[str, Path]] = None,
    audio: Optional[np.ndarray] = None,
    audio_rate: int = 16000,
) -> bytes:
    """A video of `num_frames` test frames (video_frame) at `fps`, encoded with `codec` (mpeg4,
    libx264, ...) in `container` (mp4, webm/matroska, avi), at a high bit rate so colours survive;
    with `audio` (mono float32 at `audio_rate`), a sound track too (AAC). Also written to `path` if
    given. Sides must be even (4:2:0 chroma)."""
    buffer = io.BytesIO()
    import av  # only the tests and benchmarks that make videos load FFmpeg

    with av.open(buffer, mode="w", format=container) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.bit_rate = 4_000_000
        sound = output.add_stream("aac", rate=audio_rate) if audio is not None else None  # streams before packets
        if sound is not None:
            sound.layout = "mono"
        for index in range(num_frames):
            frame = av.VideoFrame.from_ndarray(video_frame(index, width, height), format="rgb24")
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
        if sound is not None and audio is not None:
            samples = av.AudioFrame.from_ndarray(audio[None].astype(np.float32), format="fltp", layout="mono")
            samples.sample_rate = audio_rate
            for packet in [*sound.encode(samples), *sound.encode(None)]:
                output.mux(packet)
    data = buffer.getvalue()
    if path is not None:
        Path(path).write_bytes(data)
    return data
