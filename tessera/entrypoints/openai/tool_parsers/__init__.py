"""Tool-call parsers for the formats the supported model families emit, by name (as vLLM's
`--tool-call-parser`): "hermes" (Qwen2.5, Qwen3), "llama3_json" (Llama 3.x), "mistral"."""

from __future__ import annotations

from typing import Optional

from .base import ExtractedToolCalls, ToolCall, ToolCallStream, ToolParser, make_tool_call_id
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser
from .mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called `name`; a ValueError naming the known ones otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"Unknown tool-call parser {name!r}; use one of {', '.join(sorted(TOOL_PARSERS))}.")
    return TOOL_PARSERS[name]()


def default_tool_parser(chat_template: Optional[str]) -> Optional[ToolParser]:
    """The parser for a chat template when none is named: Hermes if the template writes
    `<tool_call>` (Qwen2.5's, Qwen3's), else none (tool calls are not parsed)."""
    if chat_template and "<tool_call>" in chat_template:
        return HermesToolParser()
    return None


__all__ = [
    "ExtractedToolCalls",
    "TOOL_PARSERS",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "default_tool_parser",
    "get_tool_parser",
    "make_tool_call_id",
]
