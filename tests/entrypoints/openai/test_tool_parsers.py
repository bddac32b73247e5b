"""The tool-call parsers on outputs as the model families write them (Qwen2.5 / Qwen3 Hermes
blocks, Llama 3.1 JSON, Mistral [TOOL_CALLS]): whole and streamed, which must agree, and broken
calls given back as content instead of failing."""

from __future__ import annotations

import json

import pytest

from tessera.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ToolCall,
    default_tool_parser,
    get_tool_parser,
)

# Qwen2.5-7B-Instruct answering "What's the weather in Paris and in Rome, in celsius?" with two tools.
QWEN_TWO_CALLS = (
    "<tool_call>\n"
    '{"name": "get_current_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_current_weather", "arguments": {"location": "Rome, Italy", "unit": "celsius"}}\n'
    "</tool_call>"
)
# Qwen3 thinks first, then writes text before its call.
QWEN3_TEXT_THEN_CALL = (
    "<think>\nThe user wants the time in Tokyo; I should call get_time.\n</think>\n\n"
    "Let me check the current time in Tokyo.\n"
    "<tool_call>\n"
    '{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n'
    "</tool_call>"
)
LLAMA_CALL = '{"name": "get_current_weather", "parameters": {"location": "San Francisco, CA", "unit": "fahrenheit"}}'
LLAMA_PYTHON_TAG = (
    '<|python_tag|>{"name": "get_current_weather", "parameters": {"location": "Paris"}}; '
    '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}<|eom_id|>'
)
MISTRAL_CALLS = (
    '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": "celsius"}}, '
    '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]</s>'
)
MISTRAL_V11 = '[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}</s>'


def calls_of(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def streamed(parser_name: str, text: str, step: int = 3) -> tuple[str, list[ToolCall]]:
    """The content and calls of `text` fed `step` characters at a time, as a stream would."""
    stream = get_tool_parser(parser_name).stream()
    content, calls = "", []
    cuts = list(range(step, len(text), step)) + [len(text)]
    for cut in cuts:
        for event in stream.feed(text[:cut], final=cut == len(text)):
            if isinstance(event, ToolCall):
                calls.append(event)
            else:
                content += event
    return content, calls


PARIS = {"location": "Paris, France", "unit": "celsius"}
ROME = {"location": "Rome, Italy", "unit": "celsius"}
CASES = [
    ("hermes", QWEN_TWO_CALLS, None, [("get_current_weather", PARIS), ("get_current_weather", ROME)]),
    ("hermes", QWEN3_TEXT_THEN_CALL, QWEN3_TEXT_THEN_CALL.split("<tool_call>")[0].strip(),
     [("get_time", {"timezone": "Asia/Tokyo"})]),
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("llama3_json", LLAMA_CALL, None,
     [("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})]),
    ("llama3_json", LLAMA_PYTHON_TAG, None,
     [("get_current_weather", {"location": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]),
    ("llama3_json", "Paris is sunny today.", "Paris is sunny today.", []),
    ("mistral", MISTRAL_CALLS, None,
     [("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
      ("get_time", {"timezone": "Europe/Paris"})]),
    ("mistral", MISTRAL_V11, None, [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
    ("mistral", "Bonjour ! Il fait beau.</s>", "Bonjour ! Il fait beau.", []),
]  # fmt: skip


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_output(name, text, content, calls):
    found = get_tool_parser(name).extract(text)
    assert found.content == content
    assert calls_of(found.calls) == calls
    assert all(call.id.startswith("call_") for call in found.calls)
    assert len({call.id for call in found.calls}) == len(found.calls)


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streamed_output_agrees_with_the_whole(name, text, content, calls, step):
    streamed_content, streamed_calls = streamed(name, text, step)
    assert (streamed_content.strip() or None) == content
    assert calls_of(streamed_calls) == calls


def test_hermes_streams_text_before_a_call_as_it_comes_and_holds_a_possible_marker():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Let me check") == ["Let me check"]
    assert stream.feed("Let me check.\n<tool") == [".\n"]  # "<tool" may start <tool_call>: held back
    assert stream.feed('Let me check.\n<tool_call>\n{"name": "f", "argu') == []  # the call is not whole yet
    (call,) = stream.feed('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert (call.name, json.loads(call.arguments)) == ("f", {"x": 1})


def test_a_held_back_tail_that_is_not_a_marker_is_sent():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("a <to") == ["a "]
    assert stream.feed("a <to be or not") == ["<to be or not"]


@pytest.mark.parametrize(
    "name, text",
    [("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'),  # broken JSON
     ("hermes", '<tool_call>\n["get_weather", {"city": "Paris"}]\n</tool_call>'),  # not a call object
     ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut off by max_tokens
     ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
     ("llama3_json", '{"city": "Paris"}'),  # JSON, but no call
     ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par'),
     ("mistral", "[TOOL_CALLS]get_weather{no args marker}")],
)  # fmt: skip
def test_malformed_calls_come_back_as_content(name, text):
    found = get_tool_parser(name).extract(text)
    assert found.calls == []
    assert found.content is not None and found.content.strip()
    streamed_content, streamed_calls = streamed(name, text)
    assert streamed_calls == [] and streamed_content.strip()


def test_a_broken_call_beside_a_good_one():
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{oops}\n</tool_call>'
    found = get_tool_parser("hermes").extract(text)
    assert calls_of(found.calls) == [("a", {})]
    assert found.content == "<tool_call>\n{oops}\n</tool_call>"


def test_arguments_given_as_a_json_string_are_kept():
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}\n</tool_call>'
    (call,) = get_tool_parser("hermes").extract(text).calls
    assert json.loads(call.arguments) == {"x": [1, 2]}


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")
    assert default_tool_parser("... <tool_call> ...").name == "hermes"
    assert default_tool_parser("{{ messages }}") is None
    assert default_tool_parser(None) is None
    assert get_tool_parser("mistral").needs_special_tokens


def test_constrained_answers():
    from tessera.entrypoints.openai.tool_parsers.constrained import NamedFunctionToolParser, RequiredToolParser

    named = NamedFunctionToolParser("get_time").extract('{"timezone": "Asia/Tokyo"}')
    assert (named.content, calls_of(named.calls)) == (None, [("get_time", {"timezone": "Asia/Tokyo"})])
    required = RequiredToolParser().extract('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]')
    assert calls_of(required.calls) == [("a", {"x": 1}), ("b", {})]
    assert RequiredToolParser().extract("[]").content == "[]"  # not a call list: content
    assert NamedFunctionToolParser("f").extract('{"x": ').calls == []
    stream = RequiredToolParser().stream()
    assert stream.feed('[{"name": "a", "param') == []  # read once the answer ends
    assert calls_of(stream.feed('[{"name": "a", "parameters": {}}]', final=True)) == [("a", {})]
