"""How to sample each request's output, checked on construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

from .lora.request import LoRARequest
from .pooling_params import PoolingParams

_GREEDY_EPSILON = 1e-5
_SEED_RANGE = (-(2**63), 2**63 - 1)  # what torch.Generator.manual_seed takes (n outputs use seed + index)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output's text (vLLM's names): exactly one of the fields below is set. The
    engine compiles it into a grammar when the request is added and masks every token that would
    leave it; the output ends (finish reason "stop") when the grammar is complete."""

    json: Union[dict, str, None] = None
    """A JSON schema (a dict, or its JSON text): the output is a JSON value that validates against it."""

    json_object: Optional[bool] = None
    """True: the output is any JSON object."""

    regex: Optional[str] = None
    """The output fully matches this regular expression."""

    choice: Optional[list[str]] = None
    """The output is exactly one of these strings."""

    grammar: Optional[str] = None
    """The output is a sentence of this EBNF (GBNF-style) grammar, starting at rule `root`."""

    disable_any_whitespace: bool = True
    """JSON (json, json_object) written with single spaces after `:` and `,` and no other whitespace
    between tokens. False allows any whitespace there, as vLLM does by default; the default here is
    True because a model that has not learnt JSON well can spend all its tokens on whitespace."""

    def __post_init__(self) -> None:
        given = [
            f.name
            for f in fields(self)
            if f.name != "disable_any_whitespace" and getattr(self, f.name) not in (None, False)
        ]
        if len(given) != 1:
            names = ", ".join(f.name for f in fields(self) if f.name != "disable_any_whitespace")
            got = f"got {', '.join(given)}" if given else "got none"
            raise ValueError(f"structured_outputs takes exactly one of {names}; {got}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError(
                    f"structured_outputs.json must be a JSON schema (an object), got {type(schema).__name__}"
                )
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, (list, tuple))
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        return next(f.name for f in fields(self) if f.name != "disable_any_whitespace" and getattr(self, f.name))

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> "StructuredOutputsParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"Unknown structured_outputs field(s) {', '.join(map(repr, unknown))}")
        return cls(**value)


@dataclass
class SamplingParams:
    n: int = 1
    """Number of outputs to generate for the prompt."""

    max_tokens: Optional[int] = 16
    """Maximum output tokens per output; None: up to the model's context length."""

    temperature: float = 1.0
    """0 means greedy."""

    top_k: int = 0
    """Keep the k most likely tokens (0 or -1: all)."""

    top_p: float = 1.0
    """Keep the smallest set of tokens whose probabilities sum to top_p."""

    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one."""

    seed: Optional[int] = None
    """Per-request seed: the same seed gives the same output whatever else runs alongside."""

    stop: Union[str, list[str], None] = None
    """Strings that end the output (not included in it)."""

    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the output (included in the token ids, not in the text)."""

    ignore_eos: bool = False
    """Keep generating after the end-of-sequence token."""

    logprobs: Optional[int] = None
    """Return the log-probabilities of the sampled token and of this many most likely tokens."""

    truncate_prompt_tokens: Optional[int] = None
    """Keep only the last this many prompt tokens (images that do not fit whole are dropped)."""

    skip_special_tokens: bool = True

    structured_outputs: Optional[StructuredOutputsParams] = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar (a dict is converted)."""

    lora: Optional[LoRARequest] = None
    """The LoRA adapter the request runs with (`LLM.generate(..., lora_request=...)`, a served adapter's name as
    the request's `model`); None: the base model."""

    pooling: Optional[PoolingParams] = None
    """A pooling request (`LLM.embed`, `/v1/embeddings` on a `runner="pooling"` model): the prompt's pooled final
    hidden states instead of tokens (`RequestOutput.pooled`); nothing is generated."""

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}"
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be -1, 0 or positive, got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.logprobs is None or self.logprobs >= 0, f"logprobs must be >= 0, got {self.logprobs}"),
            (
                self.seed is None or _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1] - self.n,
                f"seed must be from {_SEED_RANGE[0]} to {_SEED_RANGE[1] - self.n} (64-bit), got {self.seed}",
            ),
            (
                self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
                f"truncate_prompt_tokens must be at least 1, got {self.truncate_prompt_tokens}",
            ),
            (all(s for s in self.stop), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON
