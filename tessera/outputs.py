"""What generation returns: per prompt, its outputs with text, token ids and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_output_tokens: int = 0
    token_times: list[float] = field(default_factory=list, repr=False)
    """When each output token was appended (monotonic seconds; `Scheduler.update_from_output` records them):
    the inter-token latencies are their gaps."""

    @property
    def time_to_first_token(self) -> Optional[float]:
        """Seconds from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> Optional[float]:
        """Mean seconds between output tokens after the first."""
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    """"stop" (EOS, a stop token or string), "length" (max_tokens or context), "abort", "error" (the
    engine failed while running it; see RequestOutput.error), or None while it runs."""

    stop_reason: Optional[object] = None
    """The stop string or token id that ended the output, if any."""

    logprobs: Optional[list[dict[int, float]]] = None
    """Per output token: token id -> log-probability, for the sampled and the top tokens."""

    metrics: Optional[RequestMetrics] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: Optional[str] = None
    """Why the engine failed this request (its outputs then finish with "error"), else None."""
    error_status: int = 500
    """The HTTP status of that failure: 500, the engine's fault; 400, the request's own inputs could not
    run (e.g. processor settings whose output does not fit the model)."""
    pooled: Optional[Any] = None
    """A pooling request's result (a float32 tensor: [hidden] or, pooling every token, [tokens, hidden])."""

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


@dataclass
class EmbeddingOutput:
    embedding: list
    """The vector (list of floats), or one per token for a multi-vector model (pooling "ALL")."""


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt, as vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def from_output(cls, output: RequestOutput) -> "EmbeddingRequestOutput":
        if output.pooled is None:
            raise RuntimeError(output.error or f"Request {output.request_id} ended without an embedding")
        return cls(output.request_id, output.prompt_token_ids, EmbeddingOutput(output.pooled.tolist()))


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result for one (query, document) pair, as vLLM's: the cosine of their embeddings (late
    interaction for multi-vector models)."""

    request_id: str
    prompt_token_ids: list[int]  # the document's
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class TranscriptionSegment:
    """One window of a recording and its transcript."""

    start: float
    end: float
    """Seconds from the start of the recording."""
    text: str
    token_ids: list[int]
    avg_logprob: Optional[float] = None
    """Mean log-probability of the tokens (None unless their logprobs were asked for)."""


@dataclass
class TranscriptionOutput:
    text: str
    """The whole transcript: the windows' texts joined by spaces."""
    duration: float
    """Seconds of audio."""
    language: Optional[str]
    """The ISO 639-1 code asked for, if one was."""
    segments: list[TranscriptionSegment]
