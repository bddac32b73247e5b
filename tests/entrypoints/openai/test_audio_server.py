"""Audio through the OpenAI server (Qwen2-Audio): the openai client's input_audio parts and transcriptions (a
WAV and an MP3) give the offline API's text, streamed or whole, in every response format; /tokenize counts the
audio tokens as HF's processor; hostile audio and bad forms get a JSON 400 while other requests complete."""

from __future__ import annotations

import base64
import struct
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from transformers import AutoProcessor

from tessera import LLM, SamplingParams
from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.entrypoints.openai.api_server import ServerThread, build_app
from testkit.audio import mp3_bytes, random_audio, two_hours_of_silence, wav_bytes
from testkit.qwen2_audio import build_tiny_qwen2_audio

OPTIONS = {"kv_cache_memory": "4MiB"}


def audio_message(data: bytes, fmt: str, text: str = "What is it?") -> list[dict]:
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def audio_server(tmp_path_factory):
    folder = str(build_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio")))
    engine = AsyncEngine(LLMEngine.from_options(folder, **OPTIONS))
    try:
        with ServerThread(build_app(engine, model_name="tiny")) as url:
            yield url, LLM(folder, **OPTIONS)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_input_audio_through_the_openai_client_answers_as_offline(audio_server, fmt):
    url, offline = audio_server
    samples = random_audio(1.2, seed=8)
    data = wav_bytes(samples) if fmt == "wav" else mp3_bytes(samples)
    messages = audio_message(data, fmt)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (expected,) = offline.chat(messages, params, use_tqdm=False)
    assert reply.choices[0].message.content == expected.outputs[0].text


def test_tokenize_counts_the_audio_tokens_as_hfs_processor(audio_server):
    url, offline = audio_server
    samples = random_audio(1.2, seed=8)
    messages = audio_message(wav_bytes(samples), "wav")
    reply = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": messages}, timeout=60).json()
    prompt = offline.render_chat(messages)["prompt"]
    processor = AutoProcessor.from_pretrained(offline.engine.model_config.model)
    expected = processor(text=prompt, audio=[samples], sampling_rate=16000)["input_ids"][0]
    expected = expected.tolist() if hasattr(expected, "tolist") else list(expected)
    audio_id = offline.engine.model_config.hf_config.audio_token_index
    ((span,),) = reply["mm_placeholders"].values()
    assert reply["tokens"] == expected and reply["count"] == len(expected)
    assert span["length"] == expected.count(audio_id) > 10 and set(reply["mm_placeholders"]) == {"audio"}
    assert expected[span["offset"] : span["offset"] + span["length"]] == [audio_id] * span["length"]


HOSTILE = ["header-claims-hours", "not-audio", "truncated", "two-hours-of-silence", "zero-hz"]


def hostile_file(name: str) -> bytes:
    if name == "two-hours-of-silence":
        return two_hours_of_silence()
    if name == "not-audio":
        return b"\x89PNG\r\n\x1a\n" + bytes(64)
    if name == "truncated":
        return wav_bytes(random_audio(0.5, seed=1))[:30]
    data = bytearray(wav_bytes(random_audio(0.2, seed=1)))
    if name == "zero-hz":
        data[24:28] = struct.pack("<I", 0)  # the fmt chunk's sample rate
    else:  # the data chunk's size: hours
        data[40:44] = struct.pack("<I", 0x7FFFFFF0)
    return bytes(data)


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_audio_is_a_json_400_while_other_requests_complete(audio_server, name):
    """Each hostile file, in a chat and as a transcription upload, while a long answer streams: a JSON 400
    naming the audio (a header that claims hours decodes what is there), and the long answer completes."""
    url, _ = audio_server
    long_answer = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 48,
                   "ignore_eos": True}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, url + "/v1/chat/completions", json=long_answer, timeout=120)
        data = hostile_file(name)
        body = {"model": "tiny", "messages": audio_message(data, "flac"), "max_tokens": 2}
        chat = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        upload = transcribe(url, data, name="speech.wav")
        finished = running.result()
    for response in (chat, upload):
        if name == "header-claims-hours":
            assert response.status_code == 200
        else:
            assert response.status_code == 400 and "audio" in response.json()["error"]["message"].lower()
    if name == "two-hours-of-silence":
        assert "longer than" in chat.json()["error"]["message"]
    assert finished.status_code == 200 and finished.json()["usage"]["completion_tokens"] == 48


# ---- /v1/audio/transcriptions ----------------------------------------------------------------------------

SPEECH = random_audio(4.5, seed=11)  # longer than the tiny model's 2 s window: three windows, batched
WINDOW_TOKENS = 5


def offline_transcript(offline: LLM, data: bytes, **options) -> "object":
    (result,) = offline.transcribe(data, SamplingParams(max_tokens=WINDOW_TOKENS, temperature=0.0), use_tqdm=False,
                                   **options)  # fmt: skip
    return result


def transcribe(url: str, data: bytes, name: str = "speech.wav", **fields) -> httpx.Response:
    form = {"model": "tiny", "max_completion_tokens": str(WINDOW_TOKENS), **fields}
    return httpx.post(url + "/v1/audio/transcriptions", data=form, files={"file": (name, data)}, timeout=60)


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_transcriptions_through_the_openai_client_give_the_offline_text(audio_server, fmt):
    url, offline = audio_server
    data = wav_bytes(SPEECH) if fmt == "wav" else mp3_bytes(SPEECH)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    reply = client.audio.transcriptions.create(
        model="tiny", file=(f"speech.{fmt}", data), language="en", extra_body={"max_completion_tokens": WINDOW_TOKENS}
    )
    expected = offline_transcript(offline, data, language="en")
    assert len(expected.segments) == 3 and expected.text
    assert reply.text == expected.text


def test_streamed_transcript_adds_up_to_the_whole_one(audio_server):
    url, offline = audio_server
    data = wav_bytes(SPEECH)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    events = list(client.audio.transcriptions.create(
        model="tiny", file=("speech.wav", data), stream=True, extra_body={"max_completion_tokens": WINDOW_TOKENS}
    ))  # fmt: skip
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    (done,) = [e for e in events if e.type == "transcript.text.done"]
    expected = offline_transcript(offline, data).text
    assert len(deltas) > 1 and "".join(deltas) == done.text == expected


def test_response_formats_carry_the_same_transcript(audio_server):
    url, _ = audio_server
    data = wav_bytes(SPEECH)
    whole = transcribe(url, data).json()
    assert whole["usage"] == {"type": "duration", "seconds": 5}
    text = transcribe(url, data, response_format="text")
    assert text.headers["content-type"].startswith("text/plain") and text.text == whole["text"]
    verbose = transcribe(url, data, response_format="verbose_json", language="French").json()
    assert verbose["language"] == "french" and verbose["duration"] == pytest.approx(4.5)
    segments = verbose["segments"]
    assert segments[0]["start"] == 0 and segments[-1]["end"] == pytest.approx(4.5)
    assert all(a["end"] == b["start"] and b["end"] - b["start"] <= 2.0 for a, b in zip(segments, segments[1:]))
    assert all(isinstance(s["avg_logprob"], float) and s["avg_logprob"] <= 0 for s in segments)
    srt = transcribe(url, data, response_format="srt").text
    vtt = transcribe(url, data, response_format="vtt").text
    assert srt.startswith("1\n00:00:00,000 --> 00:00:0") and vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")
    with_logprobs = transcribe(url, data, **{"include[]": "logprobs"}).json()
    assert len(with_logprobs["logprobs"]) == sum(len(s["tokens"]) for s in segments)


@pytest.mark.parametrize(
    "fields, files, param",
    [
        ({}, None, "file"),
        ({"language": "klingon"}, "wav", None),
        ({"response_format": "docx"}, "wav", None),
        ({"timestamp_granularities[]": "word", "response_format": "verbose_json"}, "wav", None),
        ({"timestamp_granularities[]": "segment"}, "wav", "timestamp_granularities"),
        ({"best_of": "2"}, "wav", "best_of"),
        ({"temperature": "hot"}, "wav", None),
        ({}, "png", None),
    ],
    ids=["no-file", "language", "format", "word-timestamps", "segments-without-verbose", "unknown", "temperature",
         "not-audio"],
)  # fmt: skip
def test_bad_transcription_requests_are_a_json_400_naming_the_problem(audio_server, fields, files, param):
    url, _ = audio_server
    body = {"model": "tiny", **fields}
    upload = {"wav": wav_bytes(SPEECH[:8000]), "png": b"\x89PNG\r\n\x1a\n" + bytes(64), None: None}[files]
    kwargs = {"files": {"file": ("speech.wav", upload)}} if upload is not None else {"files": {"x": ("x", b"")}}
    response = httpx.post(url + "/v1/audio/transcriptions", data=body, timeout=60, **kwargs)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    named = param or next(iter(fields), "audio")
    assert named.removesuffix("[]") in error["message"].lower() or "audio" in error["message"].lower()
    assert transcribe(url, wav_bytes(SPEECH[:8000])).status_code == 200
