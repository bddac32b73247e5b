"""Request bodies of the OpenAI-compatible API, and their mapping onto SamplingParams.

Nothing a client sends is silently ignored: OpenAI parameters Tessera does not implement are
accepted only with the value that means "off" (`logit_bias: {}`, `functions: []`, `echo: false`...)
and refused with a 400 naming them otherwise; unknown parameters are refused too, except a few
that only label the request for the caller's own bookkeeping (`user`, `metadata`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from ...multimodal.media import check_media_io_kwargs
from ...sampling_params import SamplingParams, StructuredOutputsParams
from .structured_outputs import GUIDED, StructuredOutputError, structured_outputs_of
from .tools import ChatTool, ToolChoice, check_tools

# OpenAI (and vLLM) parameters Tessera does not implement, with the values that mean "off".
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "functions": ([],),  # the deprecated form of tools (chat takes `tools` and `tool_choice`)
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
}
# Labels for the caller's own bookkeeping: they change nothing about the answer.
_LABELS = frozenset({"user", "metadata", "store", "service_tier"})
_SEED = Field(default=None, ge=-(2**63), le=2**63 - 1 - 16)  # torch's seed range, room for n outputs


# A request's processor kwargs: a dict here; the engine refuses keys the model's processor does not take
# and numbers that ask it for images over 8192 pixels a side (multimodal/processor_options.py).
RequestProcessorKwargs = Optional[dict[str, Any]]


def _check_media_io_kwargs(kwargs: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    check_media_io_kwargs(kwargs)  # the values are checked against the media policy when a video is decoded
    return kwargs


RequestMediaIOKwargs = Annotated[Optional[dict[str, Any]], AfterValidator(_check_media_io_kwargs)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = None  # vLLM's extension
    min_p: Optional[float] = None  # vLLM's extension
    seed: Optional[int] = _SEED
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False  # vLLM's extension
    mm_processor_kwargs: RequestProcessorKwargs = None  # vLLM's extension: HF processor kwargs, over the server's
    # structured outputs (structured_outputs.py): OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    @model_validator(mode="after")
    def _check_structured_outputs(self) -> "_SamplingRequest":
        self._structured_outputs()  # a malformed or ambiguous constraint is a 400 naming its parameter
        return self

    def _structured_outputs(self) -> Optional[StructuredOutputsParams]:
        guided = {name: getattr(self, name) for name in GUIDED}
        try:
            return structured_outputs_of(self.response_format, self.structured_outputs, guided)
        except StructuredOutputError as e:
            raise UnsupportedParameter(e.param, str(e)) from None

    @model_validator(mode="after")
    def _refuse_unimplemented(self) -> "_SamplingRequest":
        for name, value in (self.model_extra or {}).items():
            if name in _LABELS or value is None:
                continue
            if name not in _NEUTRAL:
                raise UnsupportedParameter(name, f"Unknown parameter {name!r}; this server does not support it.")
            if not any(_same(value, neutral) for neutral in _NEUTRAL[name]):
                raise UnsupportedParameter(
                    name, f"{name}={_short(value)} is not supported by this server; leave {name!r} out."
                )
        return self

    def _sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k if self.top_k is not None else -1,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop=self.stop,
            logprobs=logprobs,
            ignore_eos=self.ignore_eos,
            structured_outputs=self._structured_outputs(),
        )


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    media_io_kwargs: RequestMediaIOKwargs = None  # vLLM's: {"video": {"num_frames": N, "fps": F}}, over the server's
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[ToolChoice] = None  # OpenAI's default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True  # False: only the first call an answer makes is returned

    @model_validator(mode="after")
    def _check_tools(self) -> "ChatCompletionRequest":
        check_tools(self.tools, self.tool_choice)
        return self

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens  # None: up to the context length
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[int], None] = None
    prompt_embeds: Optional[str] = None  # vLLM's: base64 of a torch.save'd [tokens, hidden] tensor (needs the flag)
    max_tokens: Optional[int] = Field(default=16, ge=1)  # the OpenAI default for completions
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    multi_modal_uuids: Optional[dict[str, Any]] = None
    """Ids of the prompt's inline images (vLLM's shape): {"image": [id or null per <img>, in order]}."""

    @model_validator(mode="after")
    def _one_prompt(self) -> "CompletionRequest":
        if (self.prompt is None) == (self.prompt_embeds is None):
            raise ValueError('Send exactly one of "prompt" and "prompt_embeds".')
        return self

    def to_sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[dict[str, Any]]] = None
    add_generation_prompt: bool = True
    mm_processor_kwargs: RequestProcessorKwargs = None
    media_io_kwargs: RequestMediaIOKwargs = None
    tools: Optional[list[ChatTool]] = None  # rendered into the chat template, as vLLM's /tokenize does

    @model_validator(mode="after")
    def _one_of(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError('Send exactly one of "prompt" and "messages".')
        return self


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request (`input`: a text, texts, token ids or lists of them), or vLLM's chat form
    (`messages`, with image parts) for multimodal embedders."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]], None] = None
    messages: Optional[list[dict[str, Any]]] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(default=None, ge=1)
    user: Optional[str] = None  # a label
    add_generation_prompt: bool = False  # chat form: the embedders' templates end with the user's turn
    mm_processor_kwargs: RequestProcessorKwargs = None
    media_io_kwargs: RequestMediaIOKwargs = None

    @model_validator(mode="after")
    def _one_of(self) -> "EmbeddingRequest":
        if (self.input is None) == (self.messages is None):
            raise ValueError('Send exactly one of "input" and "messages".')
        if self.input is not None and (self.input == [] or self.input == ""):
            raise ValueError("input is empty.")
        return self

    def inputs(self) -> list[Union[str, list[int]]]:
        """The prompts `input` holds, one per embedding."""
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            return [given]  # type: ignore[list-item]
        return list(given or [])


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None  # vLLM's; the name decides


def check_adapter_folder(name: str, path: str) -> None:
    """A 400 naming the problem unless `path` is a PEFT adapter folder (its weights load on first use)."""
    folder = Path(path)
    if not (folder / "adapter_config.json").is_file() or not (folder / "adapter_model.safetensors").is_file():
        raise UnsupportedParameter("lora_path", f"LoRA adapter {name!r}: {path} needs adapter_config.json and "
                                   "adapter_model.safetensors (PEFT's format).")  # fmt: skip


class TranscriptionRequest(BaseModel):
    """The fields of OpenAI's multipart transcription form (the file aside), and vLLM's sampling extras."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    language: Optional[str] = None  # ISO 639-1 (or the language's English name)
    prompt: str = ""  # text the transcript continues
    response_format: Literal["json", "text", "verbose_json", "srt", "vtt"] = "json"
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    timestamp_granularities: list[Literal["segment"]] = []  # segments are the windows the model heard
    include: list[Literal["logprobs"]] = []
    stream: bool = False
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = _SEED
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)  # per window; None: up to the context
    user: Optional[str] = None  # a label

    @model_validator(mode="after")
    def _check(self) -> "TranscriptionRequest":
        if self.timestamp_granularities and self.response_format != "verbose_json":
            raise UnsupportedParameter(
                "timestamp_granularities", 'timestamp_granularities needs response_format "verbose_json".'
            )
        if self.stream and self.response_format not in ("json", "text"):
            raise UnsupportedParameter("stream", 'stream needs response_format "json" or "text".')
        return self

    def to_sampling_params(self) -> SamplingParams:
        logprobs = self.response_format == "verbose_json" or "logprobs" in self.include
        return SamplingParams(
            max_tokens=self.max_completion_tokens, temperature=self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k if self.top_k is not None else -1,
            min_p=self.min_p or 0.0, seed=self.seed, logprobs=0 if logprobs else None,
        )  # fmt: skip


class UnsupportedParameter(ValueError):
    """A request parameter this server does not implement (reported with `param` set to its name)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _same(value: Any, neutral: Any) -> bool:
    """Equal, with booleans never standing in for numbers (`echo: 0` is not `echo: false`)."""
    return (type(value) is bool) == (type(neutral) is bool) and value == neutral


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_body(message: str, kind: str = "invalid_request_error", code: int = 400, param: Optional[str] = None):
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
