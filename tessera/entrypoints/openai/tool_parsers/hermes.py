"""Hermes-style tool calls, as Qwen2.5 and Qwen3 (and NousResearch Hermes) emit them: each call a
JSON object between `<tool_call>` and `</tool_call>` lines, any text before them content.

    I'll look both up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Rome"}}
    </tool_call>"""

from __future__ import annotations

import json
from typing import Optional

from .base import ToolCall, ToolParser, call_from_json

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = (START,)

    def parse_block(self, text: str, final: bool) -> Optional[tuple[Optional[list[ToolCall]], int]]:
        end = text.find(END)
        if end < 0:
            if not final:
                return None
            end, length = len(text), len(text)  # the output ended inside the block: parse what is there
        else:
            length = end + len(END)
        try:
            value = json.loads(text[len(START) : end].strip())
        except json.JSONDecodeError:
            return None, length
        call = call_from_json(value) or call_from_json(value, "parameters")
        return ([call] if call else None), length
