"""Speech to text: a recording becomes one prompt per window the model hears, and their answers one transcript.

A recording longer than the model's window (Whisper-style encoders hear 30 s) is cut, as vLLM's speech-to-text
serving cuts it, at the quietest tenth of a second within the last second before each limit, so that no word
is split where a pause is near. Each window's prompt comes from the model's own format where it has one
(`SupportsTranscription.get_generation_prompt`, e.g. Voxtral's), else from its chat template: the audio and
an instruction to transcribe it, as a user of an audio chat model would ask.

`LLM.transcribe` and `/v1/audio/transcriptions` both plan with `Transcriber`, so they give the same text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, Optional

import numpy as np
from transformers.models.whisper.tokenization_whisper import LANGUAGES, TO_LANGUAGE_CODE

from ..config import SpeechToTextConfig
from ..errors import InputError
from ..models.interfaces import supports_transcription
from ..outputs import RequestOutput, TranscriptionOutput, TranscriptionSegment
from .input_preprocessor import InputPreprocessor

TaskType = Literal["transcribe", "translate"]


@dataclasses.dataclass(frozen=True)
class AudioWindow:
    start: float
    """Seconds from the start of the recording."""
    end: float
    prompt: Any
    """The engine prompt that asks for this window's transcript."""


class Transcriber:
    """How one model turns recordings into transcription prompts."""

    def __init__(self, preprocessor: InputPreprocessor, model_cls: type) -> None:
        self.preprocessor = preprocessor
        self.model_cls = model_cls
        self.native = supports_transcription(model_cls)  # a prompt format of its own

    @property
    def available(self) -> bool:
        """Whether the model transcribes: it says so, or it takes audio in chat."""
        return self.native or self.preprocessor.audio_placeholder is not None

    def check_available(self) -> None:
        if not self.available:
            name = self.preprocessor.model_config.hf_config.model_type
            raise InputError(f"This model ({name}) does not take audio, so it cannot transcribe; serve an audio model.")

    def speech_config(self, task: TaskType = "transcribe") -> SpeechToTextConfig:
        if self.native:
            return self.model_cls.get_speech_to_text_config(self.preprocessor.model_config, task)
        extractor = self.preprocessor.processor.info.get_feature_extractor()
        window = getattr(extractor, "chunk_length", None)
        search = 1.0 if window is None else min(1.0, window / 10)  # a cut near the limit: windows stay long
        return SpeechToTextConfig(int(extractor.sampling_rate), window, overlap_chunk_second=search)

    def language(self, language: Optional[str]) -> Optional[str]:
        """The ISO 639-1 code of `language` (a code or an English name, any case), checked; None stays None."""
        if language is None or language == "":
            return None
        code = language.strip().lower()
        code = TO_LANGUAGE_CODE.get(code, code)
        if code not in LANGUAGES:
            raise InputError(f"Unknown language {language!r}; give an ISO 639-1 code such as 'en' or 'fr'.")
        if self.native:
            try:
                self.model_cls.validate_language(code)
            except ValueError as e:
                raise InputError(str(e)) from None
        return code

    def windows(
        self, waveform: np.ndarray, *, language: Optional[str] = None, prompt: str = "", task: TaskType = "transcribe"
    ) -> list[AudioWindow]:
        """The prompts for `waveform` (mono float32 at `speech_config().sample_rate`), window by window."""
        self.check_available()
        if task != "transcribe" and not self.native:
            raise InputError("This model has no translation prompt; use /v1/audio/transcriptions.")
        config = self.speech_config(task)
        code = self.language(language)
        rate = config.sample_rate
        bounds = split_points(waveform, config)
        windows = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            piece = waveform[start:end]
            if self.native:
                window_prompt = self.model_cls.get_generation_prompt(
                    piece, config, self.preprocessor.model_config, code, task, prompt, None
                )
            else:
                window_prompt = self._chat_prompt(piece, rate, code, prompt)
            windows.append(AudioWindow(start / rate, end / rate, window_prompt))
        return windows

    def _chat_prompt(self, audio: np.ndarray, rate: int, language: Optional[str], context: str) -> dict:
        """The audio and an instruction, as a user message through the chat template (or after the audio's
        placeholder where the model has no template)."""
        instruction = "Transcribe the speech in this audio word for word"
        if language is not None:
            instruction += f"; it is in {LANGUAGES[language].title()}"
        instruction += ". Answer with the transcript only."
        if context:
            instruction += f" It continues this text: {context}"
        if self.preprocessor.chat_template is None:
            text = (self.preprocessor.audio_placeholder(0) or "") + instruction
            return {"prompt": text, "multi_modal_data": {"audio": [(audio, rate)]}}
        content = [{"type": "audio_url", "audio_url": {"url": "audio"}}, {"type": "text", "text": instruction}]
        return self.preprocessor.render_chat(
            [{"role": "user", "content": content}], lambda url: url, load_audio=lambda url: (audio, rate)
        )


def split_points(waveform: np.ndarray, config: SpeechToTextConfig) -> list[int]:
    """Sample offsets [0, ..., len] that cut `waveform` into windows of at most `config.max_audio_clip_s`."""
    rate, total = config.sample_rate, len(waveform)
    if config.max_audio_clip_s is None or total <= config.max_audio_clip_s * rate:
        return [0, total]
    if not config.allow_audio_chunking:
        raise InputError(
            f"The audio is {total / rate:.1f} s long; this model takes at most {config.max_audio_clip_s:g} s."
        )
    limit = int(config.max_audio_clip_s * rate)
    search = max(1, int(config.overlap_chunk_second * rate))
    window = max(1, int(config.min_energy_split_window_size or 1))
    points = [0]
    while total - points[-1] > limit:
        start = points[-1]
        points.append(quietest_point(waveform, max(start + 1, start + limit - search), start + limit, window))
    return points + [total]


def quietest_point(waveform: np.ndarray, lo: int, hi: int, window: int) -> int:
    """The middle of the `window`-sample stretch of least energy within [lo, hi), a cut point in (lo, hi]."""
    region = waveform[lo:hi].astype(np.float64)
    if len(region) <= window:
        return hi
    energy = np.convolve(region**2, np.ones(window), mode="valid")  # energy[i]: samples i .. i + window
    return lo + int(np.argmin(energy)) + window // 2


def join_transcripts(texts: Sequence[str]) -> str:
    """Window transcripts as one text, a space between them."""
    return " ".join(text.strip() for text in texts if text.strip())


def transcription_output(
    windows: Sequence[AudioWindow], outputs: Sequence[RequestOutput], duration: float, language: Optional[str]
) -> TranscriptionOutput:
    """The transcript of a recording from its windows' finished outputs (in window order)."""
    segments = []
    for window, output in zip(windows, outputs):
        answer = output.outputs[0]
        logprobs = [table.get(t) for t, table in zip(answer.token_ids, answer.logprobs or [])]
        known = [lp for lp in logprobs if lp is not None]
        average = sum(known) / len(known) if answer.logprobs is not None and known else None
        segments.append(TranscriptionSegment(window.start, window.end, answer.text.strip(), answer.token_ids,
                                             average))  # fmt: skip
    return TranscriptionOutput(join_transcripts([s.text for s in segments]), duration, language, segments)
