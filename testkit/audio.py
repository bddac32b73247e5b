"""Audio for tests: seeded waveforms and the files users send (WAV written with the standard library, MP3 with
PyAV)."""

from __future__ import annotations

import functools
import io
import wave

import av
import numpy as np


def random_audio(seconds: float, *, seed: int = 0, rate: int = 16000) -> np.ndarray:
    """Seeded noise and a tone, mono float32 at `rate`."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * rng.uniform(100, 1000) * t)
    return (tone + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = 16000, channels: int = 1) -> bytes:
    """16-bit PCM WAV of mono `samples` in [-1, 1], repeated on each of `channels`."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        pcm = np.repeat((samples * 32767).astype("<i2")[:, None], channels, axis=1)
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()


def mp3_bytes(samples: np.ndarray, rate: int = 16000) -> bytes:
    """The samples encoded as MP3 with PyAV (libmp3lame), as a user's file would be."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp3") as container:
        stream = container.add_stream("mp3", rate=rate)
        frame = av.AudioFrame.from_ndarray(samples[None].astype(np.float32), format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


@functools.cache
def two_hours_of_silence() -> bytes:
    """Two hours of silence as FLAC (8 kHz, ~1.3 MB: small enough to pass a body limit, long past any duration
    limit), encoded once per test process."""
    rate, minute = 8000, np.zeros((1, 8000 * 60), np.int16)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="flac") as container:
        stream = container.add_stream("flac", rate=rate)
        stream.layout = "mono"
        for i in range(120):
            frame = av.AudioFrame.from_ndarray(minute, format="s16", layout="mono")
            frame.sample_rate, frame.pts = rate, i * minute.shape[1]
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()
