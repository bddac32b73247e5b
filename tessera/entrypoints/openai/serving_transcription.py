"""`/v1/audio/transcriptions`: OpenAI's multipart form in, a transcript out (json, text, verbose_json, srt,
vtt, or a stream of `transcript.text.delta` events).

The recording is decoded off the event loop, cut into the windows the model hears (engine/transcription.py)
and every window queued at once, so they are batched together; their answers join into one transcript.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
import zlib
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from ...engine.async_engine import RequestStream, all_finished
from ...engine.engine_client import EngineClient
from ...engine.transcription import transcription_output
from ...errors import InputError
from ...outputs import RequestOutput, TranscriptionOutput
from .media_loader import AsyncMediaLoader
from .metrics import ServerMetrics
from .protocol import TranscriptionRequest, UnsupportedParameter, error_body

LIST_FIELDS = ("timestamp_granularities", "include")  # sent as "name[]", once per value


def transcription_request(form: FormData) -> tuple[TranscriptionRequest, UploadFile]:
    """(the form's fields checked, as a request; the uploaded file): every problem is a 400 naming it."""
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise UnsupportedParameter("file", "The form needs the recording as a file field named 'file'.")
    fields: dict[str, Any] = {}
    for key in form.keys():
        name = key.removesuffix("[]")
        if name == "file":
            continue
        values = [v for v in form.getlist(key) if isinstance(v, str)]
        if len(values) != len(form.getlist(key)):
            raise UnsupportedParameter(name, f"The form field {key!r} must be text, not a file.")
        if name in LIST_FIELDS:
            fields.setdefault(name, []).extend(values)
        elif name not in TranscriptionRequest.model_fields:
            raise UnsupportedParameter(name, f"Unknown parameter {name!r}; this server does not support it.")
        else:
            fields[name] = values[-1]
    try:
        return TranscriptionRequest.model_validate(fields), upload
    except ValidationError as e:
        problems = []
        for err in e.errors():
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, UnsupportedParameter):
                raise cause from None
            where = ".".join(str(x) for x in err["loc"]) or "form"
            problems.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
        raise InputError(f"Invalid request: {'; '.join(problems)}") from None


class OpenAIServingTranscription:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics, media: AsyncMediaLoader) -> None:
        self.engine, self.metrics, self.media = engine, metrics, media

    async def transcribe(self, request: TranscriptionRequest, data: bytes) -> Any:
        """The response body: a dict (JSON), a str (text, srt, vtt) or an async iterator of events."""
        transcriber = self.engine.transcriber
        transcriber.check_available()
        language = transcriber.language(request.language)
        rate = transcriber.speech_config().sample_rate
        waveform = await self.media.decode_audio(data, rate)
        windows = await asyncio.to_thread(transcriber.windows, waveform, language=language, prompt=request.prompt)
        params = request.to_sampling_params()
        request_id = f"trsc-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for i, window in enumerate(windows):  # all queued now: the engine batches them
                streams.append(await self.engine.add_request(f"{request_id}-{i}", window.prompt, params))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        duration = len(waveform) / rate
        if request.stream:
            return self._events(streams, duration)
        finals = await all_finished(streams)
        for final in finals:
            self.metrics.observe_finished(final)
        result = transcription_output(windows, finals, duration, language)
        return self._response(request, result, finals)

    def _response(self, request: TranscriptionRequest, result: TranscriptionOutput, finals: list[RequestOutput]):
        fmt = request.response_format
        if fmt == "text":
            return result.text
        if fmt in ("srt", "vtt"):
            return subtitles(result, fmt)
        usage = {"type": "duration", "seconds": math.ceil(result.duration)}
        if fmt == "json":
            body: dict[str, Any] = {"text": result.text, "usage": usage}
            if "logprobs" in request.include:
                body["logprobs"] = [self._logprob(t, table) for f in finals for t, table in _token_logprobs(f)]
            return body
        segments = [
            {"id": i, "seek": int(s.start * 100), "start": s.start, "end": s.end, "text": s.text,
             "tokens": s.token_ids, "temperature": request.temperature, "avg_logprob": s.avg_logprob,
             "compression_ratio": compression_ratio(s.text), "no_speech_prob": None}
            for i, s in enumerate(result.segments)
        ]  # fmt: skip
        language = LANGUAGES.get(result.language or "", result.language)
        return {"task": "transcribe", "language": language, "duration": result.duration, "text": result.text,
                "segments": segments, "usage": usage}  # fmt: skip

    def _logprob(self, token_id: int, table: dict[int, float]) -> dict:
        token = self.engine.tokenizer.decode([token_id])
        return {"token": token, "logprob": table.get(token_id), "bytes": list(token.encode())}

    async def _events(self, streams: list[RequestStream], duration: float) -> AsyncIterator[str]:
        """OpenAI's transcription events: `transcript.text.delta` as windows' text comes (in window order;
        their deltas add up to the final text exactly), then `transcript.text.done`."""
        text, done = "", 0
        try:
            for stream in streams:
                window, sent, separator = "", 0, " " if text else ""
                async for output in stream:
                    window = output.outputs[0].text.strip()
                    if output.finished:
                        self.metrics.observe_finished(output)
                    if len(window) > sent:
                        delta = (separator if sent == 0 else "") + window[sent:]
                        sent, text = len(window), text + delta
                        yield _event({"type": "transcript.text.delta", "delta": delta})
                done += 1
            usage = {"type": "duration", "seconds": math.ceil(duration)}
            yield _event({"type": "transcript.text.done", "text": text, "usage": usage})
        except Exception as e:  # the engine failed under this request: tell the client in-band
            status = getattr(e, "status_code", 500)
            yield _event(error_body(str(e) if status < 500 else "Internal server error.", "server_error", status))
        finally:
            for stream in streams[done:]:
                stream.abort()
        yield "data: [DONE]\n\n"


def _token_logprobs(output: RequestOutput) -> list[tuple[int, dict[int, float]]]:
    answer = output.outputs[0]
    return list(zip(answer.token_ids, answer.logprobs or []))


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def compression_ratio(text: str) -> float:
    """Whisper's repetition gauge: the text's bytes over their zlib-compressed size."""
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def subtitles(result: TranscriptionOutput, fmt: str) -> str:
    """The segments as SubRip ("srt") or WebVTT ("vtt") cues."""

    def stamp(seconds: float) -> str:
        ms = round(seconds * 1000)
        h, ms = divmod(ms, 3_600_000)
        m, ms = divmod(ms, 60_000)
        s, ms = divmod(ms, 1000)
        return f"{h:02d}:{m:02d}:{s:02d}{',' if fmt == 'srt' else '.'}{ms:03d}"

    cues = [(s.start, s.end, s.text) for s in result.segments if s.text]
    if fmt == "srt":
        return "".join(f"{i}\n{stamp(a)} --> {stamp(b)}\n{t}\n\n" for i, (a, b, t) in enumerate(cues, 1))
    return "WEBVTT\n\n" + "".join(f"{stamp(a)} --> {stamp(b)}\n{t}\n\n" for a, b, t in cues)
