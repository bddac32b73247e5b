"""What every tool-call parser shares: the calls it finds, and one scanner that serves both the
whole-response and the streamed case (so that both read a model's output the same way).

A parser says where a block of tool calls starts in the model's text (`find_start`) and how a
block reads (`parse_block`); the scanner (`ToolCallStream`) turns text into content pieces and
complete calls. Streaming buffers each block until it is complete (for Hermes, until its
`</tool_call>`; for Llama 3 JSON and Mistral, until the output ends) and then sends the call's
name and its whole arguments; text outside the blocks streams as it comes, less a tail that could
be the start of a marker. A block that does not parse is given back as content, never an error."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union


def make_tool_call_id() -> str:
    """An id in OpenAI's form: "call_" and 24 random hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as a string (as OpenAI sends it)
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: Optional[str]  # the text outside the calls; None if there is none (or only white space)
    calls: list[ToolCall]


Event = Union[str, ToolCall]  # a piece of content, or a complete call


def call_from_json(value: Any, arguments_key: str = "arguments") -> Optional[ToolCall]:
    """The call in a parsed `{"name": ..., "<arguments_key>": {...}}` object, or None if it is not one.
    Arguments given as a JSON string are taken as they are if they parse to an object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(arguments_key, {})
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return None
        if not isinstance(parsed, dict):
            return None
        return ToolCall(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def json_values(text: str) -> Optional[list[Any]]:
    """The JSON values in `text`, one after another (separated by white space, `;` or `,`), or None
    if anything in it is not JSON."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while True:
        while position < len(text) and text[position] in " \t\r\n;,":
            position += 1
        if position == len(text):
            return values
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        values.append(value)


class ToolParser:
    """One model family's tool-call format. Subclasses set `name` and `start_markers` and implement
    `parse_block`; `find_start` may be overridden for formats without a marker."""

    name: ClassVar[str]
    start_markers: ClassVar[tuple[str, ...]] = ()
    # Whether the markers are special tokens that detokenizing with skip_special_tokens would drop.
    needs_special_tokens: ClassVar[bool] = False
    # Text the parser strips from the end of the output (an end-of-turn token left in by
    # skip_special_tokens=False).
    end_tokens: ClassVar[tuple[str, ...]] = ()

    def find_start(self, text: str, position: int) -> tuple[int, int]:
        """(where the next block starts at or after `position`, or -1; how far content is safe to
        send when none starts: short of a tail that could be the beginning of a marker)."""
        found = [i for i in (text.find(marker, position) for marker in self.start_markers) if i >= 0]
        if found:
            return min(found), min(found)
        safe = len(text)
        for marker in self.start_markers:
            for length in range(min(len(marker) - 1, len(text) - position), 0, -1):
                if marker.startswith(text[len(text) - length :]):
                    safe = min(safe, len(text) - length)
                    break
        return -1, safe

    def parse_block(self, text: str, final: bool) -> Optional[tuple[Optional[list[ToolCall]], int]]:
        """For `text` starting at a block's marker: None while the block is incomplete (and the
        output goes on), else (its calls, or None if it does not parse; how many characters it
        spans)."""
        raise NotImplementedError

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole output, and the text outside them."""
        content, calls = [], []
        for event in self.stream().feed(text, final=True):
            (calls if isinstance(event, ToolCall) else content).append(event)
        joined = "".join(content)
        if calls:
            joined = joined.strip()
        return ExtractedToolCalls(joined if joined.strip() else None, calls)


class ToolCallStream:
    """A parser fed the growing text of one output: `feed` returns what became certain since the
    last call, as content pieces and complete calls, in order."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.position = 0  # everything before it has been given out
        self.calls = 0  # how many calls have been given out
        self.pending = ""  # white space after a call: dropped unless text follows it

    def feed(self, text: str, final: bool = False) -> list[Event]:
        if final:
            for token in self.parser.end_tokens:
                if text.endswith(token) and len(text) - len(token) >= self.position:
                    text = text[: -len(token)]
                    break
        else:  # a tail that is (or may become) an end token waits for the next text
            text = text[: max(self.position, len(text) - _tail_of(text, self.parser.end_tokens))]
        events: list[Event] = []
        while self.position < len(text):
            start, safe = self.parser.find_start(text, self.position)
            if start < 0:
                end = len(text) if final else safe
                if end > self.position:
                    events.append(text[self.position : end])
                    self.position = end
                break
            if start > self.position:
                events.append(text[self.position : start])
                self.position = start
            parsed = self.parser.parse_block(text[start:], final)
            if parsed is None:  # incomplete: wait for more text
                if final:  # cut off (e.g. by max_tokens): what there is goes out as content
                    events.append(text[start:])
                    self.position = len(text)
                break
            calls, length = parsed
            length = max(length, 1)
            if calls is None:
                events.append(text[start : start + length])
            else:
                events.extend(calls)
            self.position = start + length
        return self._without_gaps(_merged(events))

    def _without_gaps(self, events: list[Event]) -> list[Event]:
        """`events` less the white space between and after calls (the lines around `<tool_call>`
        blocks), which is not part of the answer's content."""
        kept: list[Event] = []
        for event in events:
            if isinstance(event, ToolCall):
                self.calls += 1
                self.pending = ""
                kept.append(event)
            elif self.calls and not (self.pending + event).strip():
                self.pending += event
            else:
                kept.append(self.pending + event if self.calls else event)
                self.pending = ""
        return kept


def _tail_of(text: str, tokens: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is the start of one of `tokens` (0 if none)."""
    for length in range(min(max((len(t) for t in tokens), default=0), len(text)), 0, -1):
        if any(token.startswith(text[len(text) - length :]) for token in tokens):
            return length
    return 0


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent content pieces as one."""
    merged: list[Event] = []
    for event in events:
        if isinstance(event, str) and merged and isinstance(merged[-1], str):
            merged[-1] += event
        elif not (isinstance(event, str) and not event):
            merged.append(event)
    return merged
