"""Structured outputs with xgrammar: a request's constraint (SamplingParams.structured_outputs) is
compiled into a grammar against the tokenizer when the request is added, each sequence walks it with
its own matcher, and each step the matchers of the sampled rows fill a token bitmask that the sampler
applies to the logits (tokens that would leave the grammar get -inf).

Compiled grammars are kept in a bounded LRU cache keyed by the constraint, so requests with the same
schema compile once. Compiling runs where the prompt is processed (a worker thread behind the
server), not on the engine's step; the bitmask of a step is filled on the CPU while the device runs
the model's forward pass."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch

from ...errors import InputError
from ...layers.sampler import TokenMask
from ...sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

    from .request import Request

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 128
"""Compiled grammars kept (least recently used dropped first)."""

_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[12:00:00] /project/cpp/x.cc:83: "


def _key(params: StructuredOutputsParams) -> tuple:
    """The cache key of a constraint: its kind and its value (a schema as compact JSON, its keys in their
    order: the order of an object's properties is the order the output writes them)."""
    kind = params.kind
    value: Any = getattr(params, kind)
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        value = json.dumps(schema, separators=(",", ":"))
    elif kind == "choice":
        value = tuple(value)
    whitespace = params.disable_any_whitespace if kind in ("json", "json_object") else False
    return kind, value, whitespace


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly the choices (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _message(error: Exception) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return _CPP_PREFIX.sub("", lines[0]) if lines else type(error).__name__


class StructuredOutputRequest:
    """One sequence's walk through its grammar."""

    def __init__(self, compiled: "xgrammar.CompiledGrammar", params: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        self.params = params
        self.vocab_size = compiled.tokenizer_info.vocab_size  # the width of its bitmask rows
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it (it then stays put)."""
        return self.matcher.accept_token(token)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: the output is done."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)


class StructuredOutputManager:
    """Compiles constraints for one tokenizer (lazily: nothing is built until a request has one) and
    keeps the compiled grammars in a bounded LRU cache. Thread-safe."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], cache_size: int = DEFAULT_CACHE_SIZE
    ) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: Optional["xgrammar.GrammarCompiler"] = None
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and logs

    def _get_compiler(self) -> "xgrammar.GrammarCompiler":
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                # our own cache is the bounded one; xgrammar's would grow without limit
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        """The compiled grammar of a constraint (from the cache if there); an invalid schema, regex or
        grammar raises InputError."""
        key = _key(params)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiler = self._get_compiler()
        kind, value, compact = key
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(value, any_whitespace=not compact, strict_mode=True)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=not compact)
            elif kind == "regex":
                compiled = compiler.compile_regex(value)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(value))
            else:
                compiled = compiler.compile_grammar(value)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InputError(f"Invalid structured output constraint ({kind}): {_message(e)}") from None
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return compiled

    def new_request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        return StructuredOutputRequest(self.compile(params), params)

    def __len__(self) -> int:
        return len(self._cache)


def token_mask(requests: Sequence["Request"]) -> Optional[TokenMask]:
    """The bitmask of the sampled rows whose request has a grammar (None if none has): row i of the
    batch is requests[i]. (Its width is the model's vocabulary, the sampler fits it to the logits.)"""
    rows = [i for i, request in enumerate(requests) if request.structured_output is not None]
    if not rows:
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(rows), requests[rows[0]].structured_output.vocab_size)
    for k, row in enumerate(rows):
        requests[row].structured_output.fill_bitmask(bitmask, k)
    return TokenMask(rows, bitmask)
