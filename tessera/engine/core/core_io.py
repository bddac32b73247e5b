"""What crosses between a front-end and the engine core (vLLM v1's EngineCoreRequest / EngineCoreOutput /
the core's ready message): plain, picklable data, so the core may run in this thread, another thread or
another process.

- `EngineCoreRequest`: one sequence to generate, processed already (token ids; items with their hash,
  tensors and placeholder; sampling parameters). A prompt with n > 1 is n of them, one per sequence.
- `EngineCoreOutput`: after a step, one sequence's new token (and logprobs), and why it ended if it did:
  EOS, a stop token id, its length limit or its grammar's end, or an error. Stop strings are the
  front-end's: it asks the core to stop the sequence (`EngineCore.abort(..., stopped=True)`).
- `EngineCoreInfo`: what a front-end needs from the core before its first request: the limits it checks
  prompts against (the context length among them), the EOS ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from ...errors import InputError
from ...outputs import RequestMetrics
from ...sampling_params import SamplingParams
from .request import MultiModalItem, RequestStatus

_SMALLER_SETTINGS = " (or processor settings that make it smaller, e.g. a lower max_pixels in mm_processor_kwargs)"


def _an(noun: str) -> str:
    return ("An " if noun[:1] in "aeiou" else "A ") + noun


@dataclass(frozen=True)
class EngineLimits:
    """What one request may use of the engine."""

    max_model_len: int
    encoder_rows: int  # the most encoder rows one item may need (encoder budget and cache)
    kv_tokens: int  # tokens the whole KV cache holds
    whole_item_tokens: Optional[int] = None  # items are never split across chunks: the step's token budget
    whole_item_modalities: Optional[tuple[str, ...]] = None  # ... items of these modalities (None: all)

    def check(self, token_ids: Sequence[int], mm_items: Sequence[MultiModalItem], max_tokens: Optional[int]) -> None:
        """InputError naming what of a processed prompt the engine cannot hold, and how to fix it."""
        num_tokens = len(token_ids)
        if num_tokens >= self.max_model_len:
            raise InputError(
                f"The prompt has {num_tokens} tokens but the model's context is {self.max_model_len}; "
                "shorten it or set truncate_prompt_tokens."
            )
        if num_tokens == 0:
            raise InputError("The prompt is empty.")
        for item in mm_items:
            if item.num_embeds > self.encoder_rows:
                raise InputError(
                    f"{_an(item.modality)} needs {item.num_embeds} encoder rows but the encoder budget is "
                    f"{self.encoder_rows} ({item.num_embeds - self.encoder_rows} over); raise "
                    f"max_num_encoder_input_tokens / encoder_cache_size or send a smaller item{_SMALLER_SETTINGS}."
                )
            kept_whole = self.whole_item_modalities is None or item.modality in self.whole_item_modalities
            if self.whole_item_tokens is not None and kept_whole and item.end - item.start > self.whole_item_tokens:
                raise InputError(
                    f"{_an(item.modality)} takes {item.end - item.start} prompt tokens, which this model prefills in "
                    f"one step, but a step holds {self.whole_item_tokens} "
                    f"({item.end - item.start - self.whole_item_tokens} over); raise max_num_batched_tokens or "
                    f"send a smaller item{_SMALLER_SETTINGS}."
                )
        needed = min(num_tokens + (max_tokens or self.max_model_len), self.max_model_len)
        if needed > self.kv_tokens:
            raise InputError(
                f"This request may need {needed} tokens of KV cache but it holds {self.kv_tokens}; "
                "raise kv_cache_memory or lower max_tokens."
            )


@dataclass(frozen=True)
class EngineCoreInfo:
    """The core's start-up report."""

    limits: EngineLimits
    eos_token_ids: frozenset[int]

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len


@dataclass
class EngineCoreRequest:
    request_id: str  # the sequence's id: the parent's, or "parent#i" for sequence i of n
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # n == 1; max_tokens within the context
    mm_items: list[MultiModalItem] = field(default_factory=list)
    arrival_time: Optional[float] = None
    prompt_embeds: Optional[Any] = None  # [T, hidden] rows standing for the prompt's tokens (PromptInputs)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[dict[int, float]]]  # one table per new token when logprobs were asked for
    metrics: RequestMetrics
    status: Optional[RequestStatus] = None  # set when the core ended the sequence
    stop_reason: Optional[object] = None  # the stop token id that ended it, if one did
    error: Optional[str] = None  # why the core failed it (status FINISHED_ERROR)
    error_status: int = 500  # 500: the engine's fault; 400: the request's own inputs could not run
    pooled: Optional[Any] = None  # a pooling request's result (a float32 tensor), when it ends

    @property
    def finished(self) -> bool:
        return self.status is not None and self.status.finished
