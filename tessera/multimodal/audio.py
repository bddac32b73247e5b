"""Audio as model input: a mono float32 waveform at the rate the model's feature extractor wants.

Offline, an audio item is a waveform (a 1-D array, taken to be at the model's rate) or a (waveform,
sampling_rate) pair, resampled when the rates differ; a multi-channel array [channels, samples] is
averaged to mono. Files and bytes (WAV, FLAC, MP3, OGG/Opus, M4A, the audio track of a video) are decoded
with PyAV, the media stack Tessera already has, and resampled by its resampler (libswresample), with
limits like the images' ones: a corrupt file, one without an audio track, a 0 Hz rate or a duration past
`max_seconds` is an `InputError` naming what is wrong.
"""

from __future__ import annotations

import io
from typing import Any, Union

import av
import numpy as np

from ..errors import InputError

MAX_AUDIO_SECONDS = 20 * 60.0
"""The longest recording decoded (Whisper-style encoders read 30 s windows; longer inputs are the caller's
to split)."""

MAX_AUDIO_CHANNELS = 32
"""The most channels a recording may have (surround and ambisonic files stay well within it)."""
MAX_SAMPLE_RATE = 384_000
"""The highest sample rate taken, in Hz (the highest studio rate)."""

AudioItem = Union[np.ndarray, tuple[np.ndarray, float]]


def as_waveform(item: Any, target_sr: int, index: int = 0) -> np.ndarray:
    """An offline audio item as a mono float32 waveform at `target_sr`."""
    if isinstance(item, tuple):
        if len(item) != 2:
            raise InputError(f"audio item {index}: a tuple must be (waveform, sampling_rate), got {len(item)} values.")
        waveform, rate = item
    else:
        waveform, rate = item, target_sr
    try:
        array = np.asarray(waveform, dtype=np.float32)
    except (TypeError, ValueError):
        raise InputError(
            f"audio item {index}: the waveform must be an array of numbers, got {type(waveform).__name__}."
        )
    if array.ndim == 2:  # [channels, samples]
        array = array.mean(axis=0)
    if array.ndim != 1 or array.size == 0:
        raise InputError(f"audio item {index}: the waveform must be 1-D (or [channels, samples]) and non-empty.")
    if not np.isfinite(array).all():
        raise InputError(f"audio item {index}: the waveform has NaN or infinite samples.")
    if not isinstance(rate, (int, float)) or not rate > 0:
        raise InputError(f"audio item {index}: the sampling rate must be a positive number, got {rate!r}.")
    return array if int(rate) == target_sr else resample(array, int(rate), target_sr)


def resample(waveform: np.ndarray, rate: int, target_sr: int) -> np.ndarray:
    """A mono float32 waveform from `rate` to `target_sr` (libswresample, through PyAV)."""
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(waveform, dtype=np.float32)[None], format="flt",
                                       layout="mono")  # fmt: skip
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target_sr)
    pieces = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    pieces += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]  # flush
    return np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)


def decode_audio_native(data: bytes, *, max_seconds: float = MAX_AUDIO_SECONDS) -> tuple[np.ndarray, int]:
    """(the audio track of an encoded file as a mono float32 waveform at its own rate, that rate)."""
    rate = _stream_rate(data)
    return decode_audio(data, rate, max_seconds=max_seconds), rate


def _stream_rate(data: bytes) -> int:
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = next(iter(container.streams.audio), None)
            rate = stream.rate if stream is not None else None
            channels = stream.codec_context.channels if stream is not None else None
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise InputError(f"The audio could not be decoded ({type(e).__name__}: {e}); send WAV, FLAC, MP3, OGG or M4A.")
    if stream is None:
        raise InputError("The file has no audio track.")
    check_stream(rate, channels)
    return int(rate)


def check_stream(rate: Any, channels: Any) -> None:
    """An InputError for an audio track whose header gives an impossible rate or too many channels."""
    if not rate or rate <= 0 or rate > MAX_SAMPLE_RATE:
        raise InputError(f"The audio track has an invalid sample rate ({rate} Hz); at most {MAX_SAMPLE_RATE} Hz.")
    if not channels or channels > MAX_AUDIO_CHANNELS:
        raise InputError(f"The audio track has {channels} channels; at most {MAX_AUDIO_CHANNELS} are taken.")


def decode_audio(data: bytes, target_sr: int, *, max_seconds: float = MAX_AUDIO_SECONDS) -> np.ndarray:
    """The audio track of an encoded file as a mono float32 waveform at `target_sr`."""
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, OSError) as e:
        raise InputError(f"The audio could not be decoded ({type(e).__name__}: {e}); send WAV, FLAC, MP3, OGG or M4A.")
    with container:
        stream = next(iter(container.streams.audio), None)
        if stream is None:
            raise InputError("The file has no audio track.")
        check_stream(stream.rate, stream.codec_context.channels)
        # the channels kept (planar float) and averaged here: a mono mix, as librosa makes it
        resampler = av.AudioResampler(format="fltp", rate=target_sr)
        pieces, samples, limit = [], 0, int(max_seconds * target_sr)
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    pieces.append(out.to_ndarray().mean(axis=0))
                    samples += pieces[-1].size
                if samples > limit:
                    raise InputError(f"The audio is longer than {max_seconds:g} seconds; send a shorter recording.")
            pieces += [out.to_ndarray().mean(axis=0) for out in resampler.resample(None)]
        except av.error.FFmpegError as e:
            raise InputError(f"The audio could not be decoded ({type(e).__name__}: {e}).")
    if not pieces or sum(p.size for p in pieces) == 0:
        raise InputError("The audio track holds no samples.")
    return np.concatenate(pieces).astype(np.float32)
