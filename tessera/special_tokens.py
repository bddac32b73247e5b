"""What a tokenizer does on its own to the text it encodes (the special tokens it adds), probed by
encoding: the attributes (``add_bos_token``...) are not kept the same way by every tokenizer class."""

from __future__ import annotations

from typing import Any


def special_tokens_added(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The token ids the tokenizer puts in front of and after the text it encodes."""
    with_special = tokenizer.encode("a")
    plain = tokenizer.encode("a", add_special_tokens=False)
    start = next((i for i in range(len(with_special)) if with_special[i : i + len(plain)] == plain), 0)
    return with_special[:start], with_special[start + len(plain) :]


def adds_special_token(tokenizer: Any, at_start: bool = True) -> bool:
    """Whether encoding text adds the tokenizer's BOS in front (`at_start`), or its EOS at the end."""
    token_id = tokenizer.bos_token_id if at_start else tokenizer.eos_token_id
    prefix, suffix = special_tokens_added(tokenizer)
    return token_id is not None and (prefix if at_start else suffix) == [token_id]
