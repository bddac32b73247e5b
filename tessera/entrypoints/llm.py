"""The offline API: `LLM(model).generate(prompts)` and `LLM(model).chat(messages)`."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional, Union

import torch
from tqdm.auto import tqdm

from ..engine.chat_utils import ContentFormat, Message
from ..engine.llm_engine import LLMEngine
from ..engine.prompt import PromptType
from ..engine.transcription import transcription_output
from ..layers.pooler import similarity
from ..lora.request import LoRARequest
from ..multimodal.audio import as_waveform, decode_audio
from ..multimodal.media import (
    LOCAL_FILES,
    check_media_io_kwargs,
    load_audio_url,
    load_image_url,
    load_video_url,
    read_media_bytes,
)
from ..outputs import EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput, TranscriptionOutput
from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams


class LLM:
    """A model served in-process. Options are those of ModelConfig, CacheConfig,
    SchedulerConfig and MultiModalConfig, e.g. `dtype`, `kv_cache_memory`, `block_size`,
    `max_num_batched_tokens`, `enable_prefix_caching`, `free_out_of_window_blocks`, `limit_mm_per_prompt`,
    `mm_processor_kwargs` (HF processor kwargs for every prompt), `quantization` ("int8": int8 weights for the
    language model's linears; "int4": 4-bit weights in groups of 32 inputs; "auto": a GGUF file's weights stay
    about as small as the file has them), `tensor_parallel_size` (split the language model over that many
    ranks: this process and worker processes, or Ray actors with `distributed_executor_backend="ray"`; a
    script using it needs an `if __name__ == "__main__":` guard, as workers are spawned)."""

    def __init__(self, model: str, **options: Any) -> None:
        self.engine = LLMEngine.from_options(model, **options)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this process exits)."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (batched by the engine); outputs in prompt order. `lora_request`: the LoRA
        adapter to run with (one for all prompts, or one or None per prompt; requests of several adapters and of
        the base model batch together).

        A prompt is a string, token ids, or {"prompt": str | "prompt_token_ids": [...],
        "multi_modal_data": {"image": image or [images], "video": video or [videos]}} (a video: a
        decoded VideoFrames, a uint8 [T, H, W, 3] array or a list of frames), optionally with "mm_processor_kwargs"
        (HF processor kwargs for this prompt, over `LLM(..., mm_processor_kwargs=...)`) and
        "multi_modal_uuids" ({"image": [id or None per image]}: a named item is cached under
        its id instead of a hash of its content; one id must always mean the same content)."""
        prompts = _as_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"Got {len(params_list)} sampling params for {len(prompts)} prompts")
        if lora_request is not None:
            loras = [lora_request] * len(prompts) if isinstance(lora_request, LoRARequest) else list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"Got {len(loras)} LoRA requests for {len(prompts)} prompts")
            params_list = [dataclasses.replace(p, lora=lora) for p, lora in zip(params_list, loras)]
        ids = self._add_all(prompts, params_list)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm or len(ids) < 2) as bar:
            for output in self._drive(ids):
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
        return [finished[i] for i in ids]

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Optional[PoolingParams] = None,
        *,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of every prompt (prompts as `generate` takes them, images too), for a model loaded
        with runner="pooling"; in prompt order. `pooling_params`: dimensions (Matryoshka), normalize."""
        params = SamplingParams(max_tokens=1, pooling=pooling_params or PoolingParams())
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [EmbeddingRequestOutput.from_output(output) for output in outputs]

    def score(
        self,
        queries: Union[PromptType, Sequence[PromptType]],
        documents: Union[PromptType, Sequence[PromptType]],
        pooling_params: Optional[PoolingParams] = None,
        *,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """How well each document answers its query (vLLM's `LLM.score`): one query against every document, or
        queries and documents paired one to one; prompts as `embed` takes them (documents may carry images). The
        score is the cosine of the two embeddings, or late interaction (MaxSim) for a multi-vector model."""
        queries, documents = _as_list(queries), _as_list(documents)
        if len(queries) not in (1, len(documents)):
            raise ValueError(f"score pairs one query with every document, or queries with documents one to one; "
                             f"got {len(queries)} queries for {len(documents)} documents")  # fmt: skip
        embedded = self.embed([*queries, *documents], pooling_params, use_tqdm=use_tqdm)
        vectors = [torch.tensor(e.outputs.embedding) for e in embedded]
        query_vectors, document_vectors = vectors[: len(queries)], vectors[len(queries) :]
        if len(query_vectors) == 1:
            query_vectors = query_vectors * len(documents)
        return [
            ScoringRequestOutput(e.request_id, e.prompt_token_ids, ScoringOutput(similarity(q, d)))
            for q, d, e in zip(query_vectors, document_vectors, embedded[len(queries) :])
        ]

    def stream(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """The outputs of one prompt as the engine produces them, step by step (the last one is
        finished); stopping the iteration early aborts the request."""
        (request_id,) = self._add_all([prompt], [sampling_params or SamplingParams()])
        yield from self._drive([request_id])

    def _add_all(self, prompts: Sequence[PromptType], params: Sequence[SamplingParams]) -> list[str]:
        """Validate and queue every prompt before running any; none is queued if one is bad."""
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(str(next(self._ids)))
                self.engine.add_request(ids[-1], prompt, p)
        except Exception:
            for request_id in ids[:-1]:
                self.engine.abort_request(request_id)
            raise
        return ids

    def _drive(self, ids: list[str]) -> Iterator[RequestOutput]:
        """The synchronous loop: step the engine until these requests finish, yielding their outputs."""
        waiting = set(ids)
        try:
            while waiting and self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.request_id in waiting:
                        if output.finished:
                            waiting.discard(output.request_id)
                        yield output
        finally:  # an error, or a caller that stopped early: leave no request behind
            for request_id in waiting:
                self.engine.abort_request(request_id)

    def chat(
        self,
        messages: Union[Sequence[Message], Sequence[Sequence[Message]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        mm_processor_kwargs: Optional[Mapping[str, Any]] = None,
        chat_template_content_format: ContentFormat = "auto",
        media_io_kwargs: Optional[Mapping[str, Mapping[str, Any]]] = None,
        tools: Optional[list[dict[str, Any]]] = None,
    ) -> list[RequestOutput]:
        """Generate replies to OpenAI-style conversations: content is a string or a list of
        {"type": "text", "text": ...}, {"type": "image_url", "image_url": {"url": ...}} and
        {"type": "video_url", "video_url": {"url": ...}} parts (data URLs or local paths; an image
        or video part may carry a "uuid" naming it), rendered through the model's chat template.
        `mm_processor_kwargs` apply to every conversation, over the LLM's own; `media_io_kwargs`
        (vLLM's) to loading: {"video": {"num_frames": N, "fps": F}} samples videos so. `tools`
        (OpenAI function tools) go to the chat template; the replies are not parsed for calls."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        media_io_kwargs = self.engine.input_preprocessor.media_io_for(media_io_kwargs, mm_processor_kwargs)
        prompts = [
            self.render_chat(
                c,
                add_generation_prompt,
                chat_template,
                content_format=chat_template_content_format,
                media_io_kwargs=media_io_kwargs,
                tools=tools,
            )  # fmt: skip
            for c in conversations
        ]
        if mm_processor_kwargs is not None:
            prompts = [{**prompt, "mm_processor_kwargs": mm_processor_kwargs} for prompt in prompts]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @property
    def chat_template(self) -> Optional[str]:
        """The model's chat template (its processor's, else its tokenizer's), if it has one."""
        return self.engine.input_preprocessor.chat_template

    def render_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        *,
        plain_fallback: bool = False,
        content_format: ContentFormat = "auto",
        media_io_kwargs: Optional[Mapping[str, Mapping[str, Any]]] = None,
        tools: Optional[list[dict[str, Any]]] = None,
    ) -> dict:
        """The engine prompt for an OpenAI-style conversation: text through the chat template,
        images and videos loaded in order (data URLs, file:// URLs, local paths or image_pil
        parts; videos sampled as `media_io_kwargs["video"]` says). With `plain_fallback`, a model
        without a template gets the last message as it is."""
        io_kwargs = check_media_io_kwargs(dict(media_io_kwargs) if media_io_kwargs is not None else None)
        load = functools.partial(load_image_url, policy=LOCAL_FILES)
        load_video = functools.partial(load_video_url, policy=LOCAL_FILES, **io_kwargs.get("video", {}))
        load_audio = functools.partial(load_audio_url, policy=LOCAL_FILES)
        return self.engine.input_preprocessor.render_chat(
            messages, load, add_generation_prompt=add_generation_prompt, chat_template=chat_template,
            content_format=content_format, plain_fallback=plain_fallback, load_video=load_video, tools=tools,
            load_audio=load_audio,
        )  # fmt: skip

    def transcribe(
        self,
        audio: Any,
        sampling_params: Optional[SamplingParams] = None,
        *,
        language: Optional[str] = None,
        prompt: str = "",
        use_tqdm: bool = True,
    ) -> list[TranscriptionOutput]:
        """Transcripts of recordings, as `/v1/audio/transcriptions` makes them (engine/transcription.py). A
        recording is a file path, a data URL, encoded bytes (WAV, FLAC, MP3, OGG, M4A), a mono waveform at the
        model's rate or a (waveform, sampling_rate) pair; give one or a list. `language`: an ISO 639-1 code (or
        name) the speech is in; `prompt`: text the transcript continues. Default sampling is greedy."""
        transcriber = self.engine.transcriber
        transcriber.check_available()
        rate = transcriber.speech_config().sample_rate
        items = audio if isinstance(audio, list) else [audio]
        code = transcriber.language(language)
        waveforms = [_waveform(item, rate, i) for i, item in enumerate(items)]
        plans = [transcriber.windows(w, language=code, prompt=prompt) for w in waveforms]
        prompts = [window.prompt for plan in plans for window in plan]
        outputs = iter(self.generate(prompts, sampling_params or SamplingParams(temperature=0.0), use_tqdm=use_tqdm))
        return [
            transcription_output(plan, [next(outputs) for _ in plan], len(w) / rate, code)
            for plan, w in zip(plans, waveforms)
        ]


def _as_list(prompts: Any) -> list:
    """One prompt (a string, a dict, token ids) or a sequence of them, as a list of prompts."""
    if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _waveform(item: Any, rate: int, index: int) -> Any:
    """A recording given to `LLM.transcribe` as a mono float32 waveform at `rate`."""
    if isinstance(item, str):
        item = read_media_bytes(item, LOCAL_FILES, kind="audio")
    if isinstance(item, (bytes, bytearray)):
        return decode_audio(bytes(item), rate)
    return as_waveform(item, rate, index)
