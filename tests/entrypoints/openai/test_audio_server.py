"""Audio through the OpenAI server (Qwen2-Audio): the openai client's input_audio parts (a WAV and an MP3)
get the offline API's answer; hostile audio gets a JSON 400 while other requests complete."""

from __future__ import annotations

import base64
import io
import struct

import av
import httpx
import numpy as np
import openai
import pytest

from tessera import LLM, SamplingParams
from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.entrypoints.openai.api_server import ServerThread, build_app
from testkit.audio import random_audio, wav_bytes
from testkit.qwen2_audio import build_tiny_qwen2_audio

OPTIONS = {"kv_cache_memory": "4MiB"}


def mp3(samples: np.ndarray, rate: int = 16000) -> bytes:
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
    data = wav_bytes(samples) if fmt == "wav" else mp3(samples)
    messages = audio_message(data, fmt)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (expected,) = offline.chat(messages, params, use_tqdm=False)
    assert reply.choices[0].message.content == expected.outputs[0].text


def hostile_files() -> dict[str, bytes]:
    header_claims_hours = bytearray(wav_bytes(random_audio(0.2, seed=1)))
    header_claims_hours[40:44] = struct.pack("<I", 0x7FFFFFF0)
    zero_rate = bytearray(wav_bytes(random_audio(0.2, seed=1)))
    zero_rate[24:28] = struct.pack("<I", 0)  # the fmt chunk's sample rate
    return {
        "truncated": wav_bytes(random_audio(0.5, seed=1))[:30],
        "zero-hz": bytes(zero_rate),
        "not-audio": b"\x89PNG\r\n\x1a\n" + bytes(64),
        "header-claims-hours": bytes(header_claims_hours),
    }


@pytest.mark.parametrize("name", sorted(hostile_files()))
def test_hostile_audio_is_a_json_400_and_the_server_goes_on(audio_server, name):
    url, _ = audio_server
    body = {"model": "tiny", "messages": audio_message(hostile_files()[name], "wav"), "max_tokens": 2}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    if name == "header-claims-hours":  # decodes what is there: a short recording, answered
        assert response.status_code == 200
    else:
        assert response.status_code == 400 and "audio" in response.json()["error"]["message"].lower()
    good = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    assert httpx.post(url + "/v1/chat/completions", json=good, timeout=60).status_code == 200
