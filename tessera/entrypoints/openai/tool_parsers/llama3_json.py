"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the whole answer one JSON object `{"name": ...,
"parameters": {...}}` (several separated by `;`), possibly after the `<|python_tag|>` token.

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

An answer that starts like JSON is held back until the output ends (only then is it known to be
whole); one that does not parse as calls is given back as content."""

from __future__ import annotations

from typing import Optional

from .base import ToolCall, ToolParser, call_from_json, json_values

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = (PYTHON_TAG,)
    needs_special_tokens = True  # <|python_tag|> is a special token
    end_tokens = ("<|eot_id|>", "<|eom_id|>")

    def find_start(self, text: str, position: int) -> tuple[int, int]:
        if position == 0:
            stripped = text.lstrip()
            if not stripped:
                return -1, 0  # nothing but white space yet: it may come before a call
            if stripped.startswith("{"):
                return len(text) - len(stripped), 0
        return super().find_start(text, position)

    def parse_block(self, text: str, final: bool) -> Optional[tuple[Optional[list[ToolCall]], int]]:
        if not final:
            return None
        body = text[len(PYTHON_TAG) :] if text.startswith(PYTHON_TAG) else text
        values = json_values(body)
        if not values:
            return None, len(text)
        calls = [call_from_json(v, "parameters") or call_from_json(v, "arguments") for v in values]
        if any(call is None for call in calls):
            return None, len(text)
        return calls, len(text)  # type: ignore[return-value]
