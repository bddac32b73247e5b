"""How to sample each request's output, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

_GREEDY_EPSILON = 1e-5
_SEED_RANGE = (-(2**63), 2**63 - 1)  # what torch.Generator.manual_seed takes (n outputs use seed + index)


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

    def __post_init__(self) -> None:
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
