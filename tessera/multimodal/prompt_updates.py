"""Prompt updates: the declarative description of what an HF processor does to the prompt.

A model author says "each image replaces one `<image>` with N image tokens"
(`PromptReplacement`) or "each image inserts its tokens after X" (`PromptInsertion`). The
processor uses it to find placeholders that the HF processor already expanded, and to expand
them itself when the HF processor was bypassed (token prompts, cached items).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Any, Generic, Optional, TypeVar, Union

import torch
from cachetools import LRUCache

_S = TypeVar("_S", str, list[int])
PromptSeq = Union[str, list[int]]


class TokenCodec:
    """Encodes/decodes prompt pieces without special tokens, memoising the repeated targets."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._encoded: LRUCache[str, list[int]] = LRUCache(maxsize=4096)

    def encode(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = self.tokenizer.encode(text, add_special_tokens=False)
        return list(ids)

    def decode(self, token_ids: list[int]) -> str:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:  # fast tokenizer: skip transformers' per-token Python checks
            return backend.decode(token_ids, skip_special_tokens=False)
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def placeholder_token_id(tokenizer: Any, placeholder: str) -> Optional[int]:
    """The token id of `placeholder` where the tokenizer has it as one token (the text encodes to
    that token alone), else None: the placeholder is then plain text to this tokenizer (as to an HF
    processor, which replaces it in the text), e.g. `<video>` in a checkpoint that never added it.
    `convert_tokens_to_ids` cannot tell: it answers the unknown token's id for a missing one."""
    ids = tokenizer.encode(placeholder, add_special_tokens=False)
    if len(ids) != 1:
        return None
    unk_token = getattr(tokenizer, "unk_token", None)
    if unk_token is not None and ids[0] == tokenizer.unk_token_id and placeholder != unk_token:
        return None
    return ids[0]


def placeholder_target(tokenizer: Any, placeholder: str) -> PromptSeq:
    """`placeholder` as a `PromptReplacement` target: its token id where it is one token, else its
    text, which is matched in the tokens it encodes to or, where those merge with the text around
    it, in the prompt's text (the text fallback of `placeholders.apply_prompt_updates`)."""
    token_id = placeholder_token_id(tokenizer, placeholder)
    return placeholder if token_id is None else [token_id]


class BoundPromptSequence:
    """A text or token sequence that can be read in either form."""

    def __init__(self, codec: TokenCodec, seq: PromptSeq) -> None:
        self.codec = codec
        self.tokenizer = codec.tokenizer
        self._seq = seq

    @cached_property
    def text(self) -> str:
        return self._seq if isinstance(self._seq, str) else self.codec.decode(self._seq)

    @cached_property
    def token_ids(self) -> list[int]:
        return self.codec.encode(self._seq) if isinstance(self._seq, str) else list(self._seq)


@dataclass
class PromptIndex:
    """A position in the prompt, computed from the prompt (text or token ids); None: not there."""

    get_match_index: Callable[[Any, PromptSeq], Optional[int]]
    description: str = field(default="the position chosen by the model's PromptIndex", compare=False)
    """How error messages name the position (a Tessera addition; optional, so vLLM code is unaffected)."""


class PromptIndexTargets:
    """Positions to use as a `target`. Whatever the mode, every item goes to that one position."""

    @staticmethod
    def start() -> PromptIndex:
        """The start of the prompt (matches even an empty prompt)."""
        return PromptIndex(lambda tokenizer, prompt: 0, "the start of the prompt")

    @staticmethod
    def prefix(seq: PromptSeq) -> PromptIndex:
        """Right after `seq`, if the prompt starts with it (`seq` is converted to the prompt's form)."""

        def get_match_index(tokenizer: Any, prompt: PromptSeq) -> Optional[int]:
            bound = BoundPromptSequence(TokenCodec(tokenizer), seq)
            prefix = bound.text if isinstance(prompt, str) else bound.token_ids
            return len(prefix) if prompt[: len(prefix)] == prefix else None

        return PromptIndex(get_match_index, f"the end of the prefix {seq!r}")

    @staticmethod
    def end() -> PromptIndex:
        """The end of the prompt (matches even an empty prompt)."""
        return PromptIndex(lambda tokenizer, prompt: len(prompt), "the end of the prompt")


PromptTarget = Union[PromptSeq, PromptIndex]


@dataclass
class PromptUpdateDetails(Generic[_S]):
    """The tokens of an update (`full`) and which of them receive the item's embeddings."""

    full: _S
    is_embed: Optional[Callable[[BoundPromptSequence], torch.Tensor]] = None
    """Maps the bound `full` sequence to a boolean mask; None: every token is an embedding."""

    @staticmethod
    def from_seq(seq: _S) -> "PromptUpdateDetails[_S]":
        return PromptUpdateDetails(full=seq)

    @staticmethod
    def select_text(seq: _S, embed_text: str) -> "PromptUpdateDetails[_S]":
        """Only tokens whose id occurs in `embed_text` (encoded without special tokens) get embeddings."""

        def is_embed(full: BoundPromptSequence) -> torch.Tensor:
            embed_ids = full.codec.encode(embed_text)
            return torch.isin(torch.tensor(full.token_ids), torch.tensor(embed_ids))

        return PromptUpdateDetails(full=seq, is_embed=is_embed)

    @staticmethod
    def select_token_id(seq: _S, embed_token_id: int) -> "PromptUpdateDetails[_S]":
        """Only the tokens equal to `embed_token_id` receive embeddings."""
        return PromptUpdateDetails(full=seq, is_embed=lambda full: torch.tensor(full.token_ids) == embed_token_id)


PromptUpdateInfo = Union[PromptSeq, PromptUpdateDetails]
PromptUpdateContent = Union[Callable[[int], PromptUpdateInfo], PromptUpdateInfo]


class UpdateMode(str, Enum):
    INSERT = "insert"
    REPLACE = "replace"


@dataclass
class PromptUpdate(ABC):
    """Base of `PromptInsertion` and `PromptReplacement`."""

    modality: str
    target: PromptTarget

    @property
    @abstractmethod
    def content(self) -> PromptUpdateContent: ...

    @property
    @abstractmethod
    def mode(self) -> UpdateMode: ...

    def resolve(self, item_idx: int) -> PromptUpdateDetails:
        content = self.content(item_idx) if callable(self.content) else self.content
        return content if isinstance(content, PromptUpdateDetails) else PromptUpdateDetails.from_seq(content)


@dataclass
class PromptInsertion(PromptUpdate):
    """Inserts each item's `insertion` right after `target`, which stays.

    All items go after the first match of `target`, in item order (vLLM's rule): further matches
    are left alone.
    """

    insertion: PromptUpdateContent = ""

    @property
    def content(self) -> PromptUpdateContent:
        return self.insertion

    @property
    def mode(self) -> UpdateMode:
        return UpdateMode.INSERT


@dataclass
class PromptReplacement(PromptUpdate):
    """Replaces `target` with each item's `replacement`.

    Item i replaces the i-th match of a text or token `target`. A `PromptIndexTargets` position
    (or an empty text target, which matches at the start) takes every item, in item order.
    """

    replacement: PromptUpdateContent = ""

    @property
    def content(self) -> PromptUpdateContent:
        return self.replacement

    @property
    def mode(self) -> UpdateMode:
        return UpdateMode.REPLACE
