"""Answers constrained to tool calls (tool_choice "required" or a named function, enforced with
structured outputs): the whole answer is the call(s) as JSON, read once the output ends.

    named function f:  {"city": "Paris"}                        (f's arguments)
    "required":        [{"name": "f", "parameters": {"city": "Paris"}}, ...]   (vLLM's form)"""

from __future__ import annotations

import json
from typing import Optional

from .base import ToolCall, ToolParser, call_from_json


class _WholeAnswer(ToolParser):
    def find_start(self, text: str, position: int) -> tuple[int, int]:
        return (0, 0) if position == 0 else (-1, len(text))

    def parse_block(self, text: str, final: bool) -> Optional[tuple[Optional[list[ToolCall]], int]]:
        if not final:
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None, len(text)
        return self.calls(value), len(text)

    def calls(self, value: object) -> Optional[list[ToolCall]]:
        raise NotImplementedError


class NamedFunctionToolParser(_WholeAnswer):
    """The answer is the named function's arguments object."""

    name = "named_function"

    def __init__(self, function: str) -> None:
        self.function = function

    def calls(self, value: object) -> Optional[list[ToolCall]]:
        call = call_from_json({"name": self.function, "arguments": value})
        return [call] if call else None


class RequiredToolParser(_WholeAnswer):
    """The answer is a list of one or more `{"name": ..., "parameters": {...}}` calls."""

    name = "required"

    def calls(self, value: object) -> Optional[list[ToolCall]]:
        if not isinstance(value, list) or not value:
            return None
        calls = [call_from_json(v, "parameters") for v in value]
        return calls if all(calls) else None  # type: ignore[return-value]
