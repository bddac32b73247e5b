"""Speech to text planning (engine/transcription.py): where long recordings are cut, the languages taken, the
prompt each window gets, and `LLM.transcribe` on every form of recording."""

from __future__ import annotations

import numpy as np
import pytest

from tessera import LLM, TINY_DEMO_MODEL, SamplingParams
from tessera.config import SpeechToTextConfig
from tessera.engine.transcription import split_points
from tessera.errors import InputError
from tessera.multimodal.audio import resample
from testkit.audio import random_audio, wav_bytes
from testkit.qwen2_audio import build_tiny_qwen2_audio

RATE = 16000
CONFIG = SpeechToTextConfig(sample_rate=RATE, max_audio_clip_s=30.0, overlap_chunk_second=1.0)


def loud(seconds: float, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, int(seconds * RATE)).astype(np.float32)


def test_a_recording_within_the_window_is_one_window():
    assert split_points(loud(30.0), CONFIG) == [0, 30 * RATE]


def test_a_long_recording_is_cut_in_the_pause_before_each_limit():
    audio = loud(75.0)
    pauses = [(29.3, 29.5), (58.4, 58.6)]  # each within the second before a limit
    for a, b in pauses:
        audio[int(a * RATE) : int(b * RATE)] = 0.0
    points = split_points(audio, CONFIG)
    assert len(points) == 4 and points[0] == 0 and points[-1] == len(audio)
    for point, (a, b) in zip(points[1:-1], pauses):
        assert a * RATE < point < b * RATE
    assert all(0 < b - a <= 30 * RATE for a, b in zip(points, points[1:]))


def test_cuts_without_pauses_still_keep_every_window_within_the_limit():
    audio = loud(200.0, seed=3)
    points = split_points(audio, CONFIG)
    lengths = np.diff(points)
    assert points[-1] == len(audio) and lengths.max() <= 30 * RATE
    assert (lengths[:-1] >= 29 * RATE).all()  # cut within the last second before each limit


def test_a_model_that_cannot_chunk_refuses_a_long_recording():
    config = SpeechToTextConfig(sample_rate=RATE, max_audio_clip_s=30.0, min_energy_split_window_size=None)
    with pytest.raises(InputError, match="at most 30 s"):
        split_points(loud(31.0), config)
    assert split_points(loud(31.0), SpeechToTextConfig(max_audio_clip_s=None)) == [0, 31 * RATE]


@pytest.fixture(scope="module")
def qwen2_audio_llm(tmp_path_factory):
    return LLM(str(build_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio"))), kv_cache_memory="8MiB")


def test_languages_are_codes_or_names_and_unknown_ones_are_refused(qwen2_audio_llm):
    transcriber = qwen2_audio_llm.engine.transcriber
    assert [transcriber.language(x) for x in ("en", "EN", "English", " french ", None, "")] == [
        "en", "en", "en", "fr", None, None
    ]  # fmt: skip
    with pytest.raises(InputError, match="klingon"):
        transcriber.language("klingon")


def test_each_window_asks_through_the_chat_template_with_its_own_audio(qwen2_audio_llm):
    transcriber = qwen2_audio_llm.engine.transcriber
    audio = random_audio(3.0, seed=4)
    windows = transcriber.windows(audio, language="de", prompt="Guten Tag.")
    assert len(windows) == 2 and windows[0].start == 0 and windows[-1].end == 3.0
    for window in windows:
        prompt = window.prompt["prompt"]
        assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
        assert (
            "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>" in prompt and "German" in prompt and "Guten Tag." in prompt
        )
        ((waveform, rate),) = window.prompt["multi_modal_data"]["audio"]
        expected = audio[int(window.start * rate) : int(round(window.end * rate))]
        assert rate == RATE and np.array_equal(waveform, expected)


def test_every_form_of_recording_gets_the_same_transcript(qwen2_audio_llm, tmp_path):
    audio = random_audio(2.5, seed=5)
    path = tmp_path / "speech.wav"
    path.write_bytes(wav_bytes(audio))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    results = qwen2_audio_llm.transcribe([audio, wav_bytes(audio), str(path)], params, use_tqdm=False)
    assert results[0].text and results[0].duration == 2.5
    assert [r.text for r in results] == [results[0].text] * 3
    assert [len(s.token_ids) for s in results[0].segments] == [4, 4]
    at_8k = resample(audio, RATE, 8000)
    (from_8k,) = qwen2_audio_llm.transcribe((at_8k, 8000), params, use_tqdm=False)
    (expected,) = qwen2_audio_llm.transcribe(resample(at_8k, 8000, RATE), params, use_tqdm=False)
    assert from_8k.text == expected.text


def test_a_model_without_audio_cannot_transcribe():
    llm = LLM(str(TINY_DEMO_MODEL), kv_cache_memory="16MiB")
    with pytest.raises(InputError, match="does not take audio"):
        llm.transcribe(random_audio(1.0))
