"""Mistral tool calls: the `[TOOL_CALLS]` token, then a JSON list of calls (Mistral 7B v0.3,
Mistral Small / Nemo with the v3 tokenizer), or `name[ARGS]{...}` per call (tokenizer v11+).

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}"""

from __future__ import annotations

import json
from typing import Optional

from .base import ToolCall, ToolParser, call_from_json

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    start_markers = (TOOL_CALLS,)
    needs_special_tokens = True  # [TOOL_CALLS] is a control token
    end_tokens = ("</s>",)

    def parse_block(self, text: str, final: bool) -> Optional[tuple[Optional[list[ToolCall]], int]]:
        body = text[len(TOOL_CALLS) :]
        start = len(body) - len(body.lstrip())
        if not body[start:]:
            return None if not final else (None, len(text))
        if body[start] in "[{":
            try:
                value, end = json.JSONDecoder().raw_decode(body, start)
            except json.JSONDecodeError:
                return None if not final else (None, len(text))
            values = value if isinstance(value, list) else [value]
            calls = [call_from_json(v) or call_from_json(v, "parameters") for v in values]
            length = len(TOOL_CALLS) + end
            return (calls if calls and all(calls) else None), length  # type: ignore[return-value]
        # name[ARGS]{...}: complete once the arguments object closes
        args = body.find(ARGS)
        if args < 0:
            return None if not final else (None, len(text))
        name = body[:args].strip()
        try:
            value, end = json.JSONDecoder().raw_decode(body, args + len(ARGS))
        except json.JSONDecodeError:
            return None if not final else (None, len(text))
        call = call_from_json({"name": name, "arguments": value})
        return ([call] if call else None), len(TOOL_CALLS) + end
