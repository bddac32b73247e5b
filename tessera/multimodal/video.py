"""Decoding untrusted video bytes into sampled RGB frames, with PyAV (FFmpeg).

The container is recognised from its first bytes (MediaPolicy.video_formats) and handed to FFmpeg
by name, so FFmpeg never probes the bytes as a playlist or any other format that reads more files.
The checks that cost nothing come before decoding: bytes, frame size (the images' aspect ratio and
smallest side too), duration and frame count from the header; duration and frame count are checked
again while decoding, since a header can lie.

Sampling is vLLM's (its OpenCV backend's `load_bytes`): `n = min(num_frames, total)`, with `fps`
also `n = min(n, floor(duration * fps))`, at least 1; all frames when `n == total`, else the
`n` indices `np.linspace(0, total - 1, n)` rounded down. `num_frames` defaults to vLLM's 32;
`num_frames=-1` (vLLM's "all") takes every frame, up to the policy's `max_video_frames`.

vLLM's `data:video/jpeg;base64,<frame>,<frame>,...` URLs (a video sent as its JPEG frames, which
`VideoMediaIO.load_base64` splits on "," and stacks) come here as `JpegFrames` (media.py reads the
URL): the same limits (bytes, frame count, frame size), the same sampling with the frame rate
unknown (so `fps` caps nothing), and no timing: `VideoFrames.metadata` is None, as for frames
given as an array.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
from PIL import Image

from ..errors import InputError, InputTooLargeError
from .audio import decode_audio_native
from .image_decode import _open_lock, check_size, to_rgb
from .media_policy import MediaPolicy

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_NUM_FRAMES",
    "JpegFrames",
    "VideoFrames",
    "decode_jpeg_frames",
    "decode_video",
    "sample_frame_indices",
    "video_format",
]

DEFAULT_NUM_FRAMES = 32
"""Frames sampled when neither `num_frames` nor the caller says otherwise (vLLM's VideoMediaIO default)."""

# The container names of MediaPolicy.video_formats -> FFmpeg's demuxer for them.
FFMPEG_FORMATS = {"MP4": "mov", "WEBM": "matroska", "AVI": "avi"}
MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot")
DURATION_SLACK = 1.0  # seconds a frame's timestamp may pass max_video_duration (rounding, start offsets)


@dataclass(frozen=True)
class VideoFrames:
    """Frames sampled from a video, and where they came from (what HF video processors take as
    `video_metadata`: see `metadata`)."""

    frames: np.ndarray
    """The sampled frames: uint8, [T, H, W, 3], RGB."""
    fps: float
    """Frames per second of the source video."""
    duration: float
    """Seconds the source video lasts."""
    total_num_frames: int
    """Frames in the source video."""
    frames_indices: tuple[int, ...]
    """The index in the source video of each sampled frame."""
    audio: Optional[tuple[np.ndarray, int]] = None
    """The video's sound track (mono float32 waveform, its sampling rate), when it was asked for (`with_audio`:
    Qwen2.5-Omni's use_audio_in_video)."""

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def width(self) -> int:
        return int(self.frames.shape[2])

    @property
    def height(self) -> int:
        return int(self.frames.shape[1])

    @property
    def timestamps(self) -> list[float]:
        """Seconds into the video of each sampled frame (index / fps, as transformers computes it)."""
        return [i / self.fps for i in self.frames_indices] if self.fps > 0 else [0.0] * len(self.frames_indices)

    @property
    def metadata(self) -> Optional[dict[str, Any]]:
        """The fields of transformers' `VideoMetadata` (video_utils.py): `VideoMetadata(**metadata)`;
        None when the frame rate is unknown (JPEG frames: as for frames given as an array)."""
        if self.fps <= 0:
            return None
        return {
            "total_num_frames": self.total_num_frames,
            "fps": self.fps,
            "width": self.width,
            "height": self.height,
            "duration": self.duration,
            "video_backend": "pyav",
            "frames_indices": list(self.frames_indices),
        }


class JpegFrames(tuple):
    """The frames of a vLLM `data:video/jpeg;base64,...` URL: each frame's JPEG bytes, in order."""


def video_format(data: bytes) -> Optional[str]:
    """The container of `data` from its first bytes: "MP4" (also QuickTime), "WEBM" (also
    Matroska), "AVI", or None if none of these."""
    if data[4:8] in MP4_BOXES:
        return "MP4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "WEBM"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "AVI"
    return None


def sample_frame_indices(total: int, source_fps: float, num_frames: int, fps: Optional[float]) -> list[int]:
    """vLLM's sampling (module docstring): which of `total` frames to keep. num_frames=-1: no cap."""
    n = total if num_frames < 0 else min(num_frames, total)
    if fps is not None and source_fps > 0:
        n = min(n, math.floor(total / source_fps * fps))
    n = max(1, n)
    if n >= total:
        return list(range(total))
    return np.linspace(0, total - 1, n, dtype=int).tolist()


def check_sampling(num_frames: Optional[int], fps: Optional[float], policy: MediaPolicy) -> int:
    if num_frames is None:
        num_frames = DEFAULT_NUM_FRAMES
    if (
        isinstance(num_frames, bool)
        or not isinstance(num_frames, (int, np.integer))
        or (num_frames < 1 and num_frames != -1)
    ):
        raise InputError(f"num_frames must be a whole number of at least 1 (or -1 for all frames), not {num_frames!r}.")
    if num_frames > policy.max_video_frames:
        raise InputError(
            f"num_frames={num_frames} is over the limit of {policy.max_video_frames} frames per video "
            "(max_video_frames); ask for fewer frames."
        )
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < math.inf):
        raise InputError(f"fps must be a number above 0, not {fps!r}.")
    return int(num_frames)


def decode_failed(error: BaseException, what: str = "video") -> InputError:
    logger.info("A video could not be decoded: %s: %s", type(error).__name__, error)
    return InputError(f"The {what} could not be decoded: it is corrupt, truncated, or not a video file.")


def decode_video(
    data: Union[bytes, JpegFrames],
    policy: Optional[MediaPolicy] = None,
    *,
    num_frames: Optional[int] = None,
    fps: Optional[float] = None,
    with_audio: bool = False,
) -> VideoFrames:
    """The frames of the video in `data`, sampled as the module docstring says (CPU work: every
    frame up to the last sampled one is decoded), and with `with_audio` its sound track (an InputError
    if it has none). InputError (InputTooLargeError for sizes) naming the limit for anything the policy
    refuses, or the video cannot be read. `JpegFrames` go to decode_jpeg_frames."""
    if isinstance(data, JpegFrames):
        if with_audio:
            raise InputError("JPEG frames carry no sound track; send the video file to hear its audio.")
        return decode_jpeg_frames(data, policy, num_frames=num_frames, fps=fps)
    video = _decode_video_file(data, policy, num_frames, fps)
    if not with_audio:
        return video
    try:
        track = decode_audio_native(data)
    except InputError as e:
        raise InputError(f"The video's sound track could not be read ({e}); leave use_audio_in_video out.") from None
    return dataclasses.replace(video, audio=track)


def _decode_video_file(
    data: bytes, policy: Optional[MediaPolicy], num_frames: Optional[int], fps: Optional[float]
) -> VideoFrames:
    import av  # FFmpeg's libraries load on the first video, not on every import of the media layer

    policy = policy or MediaPolicy()
    num_frames = check_sampling(num_frames, fps, policy)
    if len(data) > policy.max_video_bytes:
        raise InputTooLargeError(
            f"The video is over the size limit of {policy.max_video_bytes} bytes (max_video_bytes)."
        )
    container_name = video_format(data)
    if policy.video_formats is not None and container_name not in policy.video_formats:
        allowed = ", ".join(policy.video_formats)
        raise InputError(f"The video could not be decoded: it is not a video file of a supported format ({allowed}).")
    ffmpeg_format = FFMPEG_FORMATS.get(container_name) if policy.video_formats is not None else None

    def open_container() -> Any:
        try:
            return av.open(io.BytesIO(data), mode="r", format=ffmpeg_format)
        except Exception as e:  # FFmpeg reports hostile bytes in many ways; none is the server's fault
            raise decode_failed(e) from None

    container = open_container()
    try:
        if not container.streams.video:
            raise InputError("The file has no video stream; send a video file.")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        check_frame_size(width, height, policy)
        rate = stream.average_rate or stream.guessed_rate
        source_fps = float(rate) if rate else 0.0
        header_duration = header_duration_of(stream, container)
        if header_duration is not None:
            check_duration(header_duration, policy)
        total = stream.frames
        if total <= 0:  # not in the header (e.g. WebM): count the packets, one per frame
            total = sum(1 for packet in container.demux(stream) if packet.size)
            container.close()
            container = open_container()
            stream = container.streams.video[0]
        check_frame_count(total, policy)
        if total == 0:
            raise InputError("The video has no frames.")
        indices = sample_frame_indices(total, source_fps, num_frames, fps)
        check_sampled_count(len(indices), policy)
        frames, found, decoded = decode_frames(av, container, stream, indices, (width, height), policy)
    finally:
        container.close()
    if not frames:
        raise decode_failed(ValueError("no frame decoded"))
    if decoded < total:  # the header overstated the frames (a truncated file): what was there
        logger.info("A video said %d frames and had %d.", total, decoded)
        total = decoded
    duration = total / source_fps if source_fps > 0 else (header_duration or 0.0)
    return VideoFrames(
        frames=np.stack(frames),
        fps=source_fps,
        duration=duration,
        total_num_frames=total,
        frames_indices=tuple(found),
    )


def check_sampled_count(count: int, policy: MediaPolicy) -> None:
    if count > policy.max_video_frames:
        raise InputError(
            f"The video would give {count} frames, over the limit of {policy.max_video_frames} frames "
            "per video (max_video_frames); ask for fewer with num_frames or fps."
        )


def decode_jpeg_frames(
    frames: Sequence[bytes],
    policy: Optional[MediaPolicy] = None,
    *,
    num_frames: Optional[int] = None,
    fps: Optional[float] = None,
) -> VideoFrames:
    """A video from its JPEG frames (vLLM's `video/jpeg` data URLs), sampled as decode_video samples
    a video whose frame rate is unknown: `n = min(num_frames, total)` frames at
    `np.linspace(0, total - 1, n)` rounded down, `fps` ignored. Every frame's header is checked (a
    JPEG, the video frame size limits, one size for all) before the sampled frames are decoded;
    the bytes limit is the reader's (media.read_video_data)."""
    policy = policy or MediaPolicy()
    num_frames = check_sampling(num_frames, fps, policy)
    total = len(frames)
    check_frame_count(total, policy)
    if total == 0:
        raise InputError("The video has no frames.")
    size: Optional[tuple[int, int]] = None
    for index, data in enumerate(frames):
        frame_size = open_jpeg(data, index).size
        if size is None:
            check_frame_size(*frame_size, policy)
            size = frame_size
        elif frame_size != size:
            raise InputError(
                f"The video's JPEG frames differ in size: frame 0 is {size[0]}x{size[1]} pixels, frame {index} "
                f"{frame_size[0]}x{frame_size[1]}; send frames of one size."
            )
    indices = sample_frame_indices(total, 0.0, num_frames, fps)
    check_sampled_count(len(indices), policy)
    decoded = []
    for index in indices:
        image = open_jpeg(frames[index], index)
        try:
            image.load()
        except Exception as e:
            logger.info("A video's JPEG frame could not be decoded: %s: %s", type(e).__name__, e)
            raise InputError(f"The video's frame {index} could not be decoded: a corrupt or truncated JPEG.") from None
        decoded.append(np.asarray(to_rgb(image)))
    return VideoFrames(
        frames=np.stack(decoded), fps=0.0, duration=0.0, total_num_frames=total, frames_indices=tuple(indices)
    )


def open_jpeg(data: bytes, index: int) -> Image.Image:
    """Frame `index` opened (its header read), or an InputError if it is not a JPEG image."""
    try:
        with _open_lock, warnings.catch_warnings():  # the pixel limit is check_frame_size's
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=["JPEG"])
    except Image.DecompressionBombError:
        raise InputTooLargeError(f"The video's frame {index} is over PIL's pixel limit; send smaller frames.") from None
    except Exception as e:
        logger.info("A video's JPEG frame could not be read: %s: %s", type(e).__name__, e)
        raise InputError(f"The video's frame {index} could not be decoded: it is not a JPEG image.") from None


def decode_frames(
    av: Any, container: Any, stream: Any, indices: list[int], size: tuple[int, int], policy: MediaPolicy
) -> tuple[list[np.ndarray], list[int], int]:
    """The RGB frames at `indices` (sorted), their indices, and how many frames were decoded."""
    wanted, last = set(indices), indices[-1]
    frames: list[np.ndarray] = []
    found: list[int] = []
    decoded = 0
    try:
        for index, frame in enumerate(container.decode(stream)):
            decoded = index + 1
            check_frame_count(decoded, policy)
            if frame.time is not None and frame.time > policy.max_video_duration + DURATION_SLACK:
                check_duration(frame.time, policy)
            if index in wanted:
                if (frame.width, frame.height) != size:  # the size changed mid-stream: check, then scale back
                    check_frame_size(frame.width, frame.height, policy)
                frames.append(frame.to_ndarray(format="rgb24", width=size[0], height=size[1]))
                found.append(index)
            if index >= last:
                break
    except InputError:
        raise
    except av.FFmpegError as e:  # a truncated or corrupt stream: keep the frames before the damage
        logger.info("A video stopped decoding after %d frames: %s", decoded, e)
        if not frames:
            raise decode_failed(e) from None
    except Exception as e:
        raise decode_failed(e) from None
    return frames, found, decoded


def header_duration_of(stream: Any, container: Any) -> Optional[float]:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # av.time_base
    return None


def check_frame_size(width: int, height: int, policy: MediaPolicy) -> None:
    """The images' aspect ratio and smallest side limits, and max_video_frame_pixels."""
    if width * height > policy.max_video_frame_pixels:
        raise InputTooLargeError(
            f"The video's frames are {width}x{height} pixels, over the limit of {policy.max_video_frame_pixels} "
            "pixels (max_video_frame_pixels); send a smaller video."
        )
    try:
        check_size(width, height, policy)
    except InputError as e:
        message = str(e).replace("The image is", "The video's frames are", 1).replace("images must", "frames must")
        raise type(e)(message) from None


def check_duration(seconds: float, policy: MediaPolicy) -> None:
    if seconds > policy.max_video_duration:
        raise InputTooLargeError(
            f"The video lasts {seconds:.1f} seconds, over the limit of {policy.max_video_duration:g} seconds "
            "(max_video_duration); send a shorter video."
        )


def check_frame_count(count: int, policy: MediaPolicy) -> None:
    if count > policy.max_video_decoded_frames:
        raise InputTooLargeError(
            f"The video has over {policy.max_video_decoded_frames} frames, the limit "
            "(max_video_decoded_frames); send a shorter video or one with fewer frames per second."
        )
