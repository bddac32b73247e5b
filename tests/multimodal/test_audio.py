"""Audio inputs (multimodal/audio.py): offline waveforms at any rate, decoded files, and bad audio refused
with a clear error."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from tessera.errors import InputError
from tessera.multimodal.audio import as_waveform, decode_audio, decode_audio_native, resample
from tessera.multimodal.parse import AudioProcessorItems, MultiModalDataParser
from testkit.audio import wav_bytes


def tone(seconds: float, rate: int, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * math.pi * hz * t)).astype(np.float32)


def test_a_wav_file_decodes_to_its_samples_at_the_models_rate():
    samples = tone(0.5, 16000)
    decoded = decode_audio(wav_bytes(samples, 16000, channels=2), 16000)  # stereo: averaged to mono
    assert decoded.dtype == np.float32 and abs(decoded.size - samples.size) <= 1
    np.testing.assert_allclose(decoded[: samples.size], samples[: decoded.size], atol=1e-3)
    at_8k = decode_audio(wav_bytes(samples, 16000), 8000)
    assert abs(at_8k.size - samples.size // 2) <= 32  # half the samples, the resampler's delay aside


def test_offline_waveforms_are_resampled_and_checked():
    samples = tone(1.0, 44100, hz=200.0)
    out = as_waveform((samples, 44100), 16000)
    assert abs(out.size - 16000) <= 64
    # the tone survives: its strongest frequency is still 200 Hz
    spectrum = np.abs(np.fft.rfft(out[:16000]))
    assert abs(np.argmax(spectrum) - 200) <= 2  # 16000 samples at 16 kHz: bin k is k Hz
    assert as_waveform(tone(0.1, 16000), 16000).size == 1600  # no rate given: the model's
    np.testing.assert_allclose(resample(samples, 44100, 44100)[:1000], samples[:1000], atol=1e-4)  # same rate
    with pytest.raises(InputError, match="sampling rate must be a positive number"):
        as_waveform((samples, 0), 16000)
    with pytest.raises(InputError, match="NaN or infinite"):
        as_waveform(np.array([0.0, np.nan]), 16000)
    with pytest.raises(InputError, match="1-D"):
        as_waveform(np.zeros((2, 3, 4)), 16000)


def test_the_parser_takes_one_item_pairs_and_lists():
    parser = MultiModalDataParser(target_sr=16000)
    one = parser.parse_mm_data({"audio": tone(0.2, 16000)})["audio"]
    pair = parser.parse_mm_data({"audio": (tone(0.2, 8000), 8000)})["audio"]
    several = parser.parse_mm_data({"audio": [tone(0.1, 16000), (tone(0.1, 32000), 32000)]})["audio"]
    assert isinstance(one, AudioProcessorItems) and one.get_count() == 1 and one.get_audio_length(0) == 3200
    assert abs(pair.get_audio_length(0) - 3200) <= 64
    assert several.get_count() == 2 and abs(several.get_audio_length(1) - 1600) <= 64


@pytest.mark.parametrize(
    "data, message",
    [
        (b"not audio at all", "could not be decoded"),
        (wav_bytes(tone(0.5, 16000), 16000)[:30], "could not be decoded|no samples|no audio track"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "could not be decoded|no audio track"),
    ],
    ids=["garbage", "truncated", "png"],
)
def test_bad_files_are_input_errors(data, message):
    with pytest.raises(InputError, match=message):
        decode_audio(data, 16000)


def test_a_header_claiming_hours_decodes_what_is_there_and_a_long_file_is_refused():
    data = bytearray(wav_bytes(tone(0.2, 16000), 16000))
    data[4:8] = struct.pack("<I", 0x7FFFFFF0)  # RIFF size: hours of audio
    data[40:44] = struct.pack("<I", 0x7FFFFFF0)  # data size
    decoded = decode_audio(bytes(data), 16000)
    assert decoded.size <= 3300
    with pytest.raises(InputError, match="longer than 1 seconds"):
        decode_audio(wav_bytes(np.zeros(16000 * 3, np.float32), 16000), 16000, max_seconds=1)


@pytest.mark.parametrize("field, value, message", [(24, 10_000_000, "invalid sample rate"), (22, 200, "200 channels")],
                         ids=["rate", "channels"])  # fmt: skip
def test_headers_claiming_absurd_rates_or_channels_are_refused(field, value, message):
    data = bytearray(wav_bytes(tone(0.2, 16000), 16000))
    data[field : field + (4 if field == 24 else 2)] = struct.pack("<I" if field == 24 else "<H", value)
    with pytest.raises(InputError, match=message):
        decode_audio_native(bytes(data))
    with pytest.raises(InputError, match=message):
        decode_audio(bytes(data), 16000)
