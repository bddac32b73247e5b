"""Incremental detokenization with stop strings.

Decoding a few tokens of left context with each new token gives the same text as decoding the
whole output (byte-level and sentencepiece decoders both depend on neighbours), and a text that
ends in an incomplete UTF-8 character is held back until the character completes.
"""

from __future__ import annotations

from typing import Any, Optional


def decode(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer, without transformers' per-token Python checks
        return backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str], skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.stop, self.skip_special_tokens = tokenizer, stop, skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = self.read_offset = 0

    def add(self, token_id: int) -> Optional[str]:
        """Append a token; returns the stop string it completed, if any (the text is cut before it)."""
        self.token_ids.append(token_id)
        prefix = decode(self.tokenizer, self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.tokenizer, self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # nothing printable yet
        checked_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        for stop in self.stop:
            at = self.text.find(stop, checked_from)
            if at >= 0:
                self.text = self.text[:at]
                return stop
        return None

    def finish(self, stopped_by_string: bool = False, drop_last_token: bool = False) -> str:
        """The final text: everything, including a trailing incomplete character, unless a stop
        string already cut it; without the last token if it was a stop token."""
        if not stopped_by_string:
            token_ids = self.token_ids[:-1] if drop_last_token else self.token_ids
            self.text = decode(self.tokenizer, token_ids, self.skip_special_tokens)
        return self.text
