"""Tool calling through the OpenAI-compatible server with the official `openai` client, on a tiny
random Qwen2.5-style checkpoint whose chat template is Qwen2.5's (it writes `<tool_call>`, so the
server reads answers with the Hermes parser): the tools reach the prompt, assistant tool calls and
tool results are rendered as the template expects, and answers are parsed into `tool_calls`, whole
and streamed. A random model never writes a call by itself, so those tests run the real request
and replace the text it produced with a recorded Qwen2.5 answer (`scripted`)."""

from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.entrypoints.openai.api_server import build_app
from tessera.entrypoints.openai.http_server import ServerThread
from testkit.tool_calling import build_tiny_qwen2_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}}},
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris and in Rome?"}]
# Qwen2.5-7B-Instruct's answer to ASK with TOOLS (as it writes it), a sentence first.
ANSWER = (
    "I'll look up both cities.\n"
    "<tool_call>\n"
    '{"name": "get_current_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_current_weather", "arguments": {"location": "Rome, Italy", "unit": "celsius"}}\n'
    "</tool_call>"
)
CALLS = [
    ("get_current_weather", {"location": "Paris, France", "unit": "celsius"}),
    ("get_current_weather", {"location": "Rome, Italy", "unit": "celsius"}),
]


class ScriptedStream:
    """The engine's stream for a request with its outputs' text replaced by `text`, revealed a few
    characters per engine step (all of it, and finish reason "stop", at the end)."""

    def __init__(self, stream, text: str, step: int = 9) -> None:
        self.stream, self.text, self.step = stream, text, step

    def abort(self) -> None:
        self.stream.abort()

    async def __aiter__(self):
        shown = 0
        async for output in self.stream:
            shown += self.step
            outputs = [
                dataclasses.replace(c, text=self.text, finish_reason="stop")
                if c.finished
                else dataclasses.replace(c, text=self.text[:shown])
                for c in output.outputs
            ]
            yield dataclasses.replace(output, outputs=outputs)


class ScriptedEngine:
    """The AsyncEngine, with each request's answer replaced by `text` when one is set."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.wrapped, self.text, self.prompts, self.params = engine, None, [], []

    def __getattr__(self, name: str):
        return getattr(self.wrapped, name)

    async def add_request(self, request_id, prompt, params):
        self.prompts.append(prompt)
        self.params.append(params)
        if getattr(params, "structured_outputs", None) is not None:  # the wiring is tested, not the engine's part
            params = dataclasses.replace(params, structured_outputs=None)
        stream = await self.wrapped.add_request(request_id, prompt, params)
        return stream if self.text is None else ScriptedStream(stream, self.text)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base URL, the scripted engine)."""
    folder = build_tiny_qwen2_tools(tmp_path_factory.mktemp("qwen2_tools"))
    engine = AsyncEngine(LLMEngine.from_options(str(folder), kv_cache_memory="16MiB", max_model_len=4096))
    app = build_app(engine, model_name="tiny")
    scripted = ScriptedEngine(engine)
    app.state.serving.engine = scripted
    try:
        with ServerThread(app) as url:
            yield url, scripted
    finally:
        engine.shutdown()


@pytest.fixture
def scripted(server):
    server[1].text, server[1].prompts[:] = None, []
    yield server[1]
    server[1].text = None


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def create(client, **kwargs):
    options = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    return client.chat.completions.create(**{**options, **kwargs})


def test_tools_are_rendered_into_the_prompt(client, scripted):
    create(client)
    prompt = scripted.prompts[-1]["prompt"]
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>" in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is the weather like in Paris and in Rome?<|im_end|>\n"
                           "<|im_start|>assistant\n")  # fmt: skip


def test_tool_choice_none_keeps_the_tools_out_of_the_prompt(client, scripted):
    scripted.text = ANSWER
    response = create(client, tool_choice="none")
    assert "<tools>" not in scripted.prompts[-1]["prompt"]
    assert response.choices[0].message.content == ANSWER  # not parsed either
    assert response.choices[0].message.tool_calls is None


def test_tokenize_renders_the_tools(server):
    with_tools = httpx.post(server[0] + "/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    without = httpx.post(server[0] + "/tokenize", json={"messages": ASK}).json()
    assert with_tools["count"] > without["count"] + 40


def test_a_real_answer_has_the_chat_shape(client):
    response = create(client)  # the random model's own answer: no call in it
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.tool_calls is None
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 12


def test_a_tool_call_answer(client, scripted):
    scripted.text = ANSWER
    response = create(client)
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I'll look up both cities."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLS
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == 2


def test_parallel_tool_calls_false_keeps_the_first_call(client, scripted):
    scripted.text = ANSWER
    response = create(client, parallel_tool_calls=False)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in response.choices[0].message.tool_calls] == (
        CALLS[:1]
    )


def test_a_streamed_tool_call_answer(client, scripted):
    scripted.text = ANSWER
    content, calls, reasons, ids = "", {}, [], {}
    for chunk in create(client, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.id:  # the first delta of a call: its id, type and name
                    assert call.index not in calls and call.type == "function"
                    ids[call.index] = call.id
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert content.strip() == "I'll look up both cities."
    assert [(name, json.loads(arguments)) for _, (name, arguments) in sorted(calls.items())] == CALLS
    assert sorted(calls) == [0, 1] and all(i.startswith("call_") for i in ids.values())
    assert reasons == ["tool_calls"]


def test_an_answer_without_calls_streams_as_text(client, scripted):
    scripted.text = "Paris is sunny and Rome is warm; I need no tool for that."
    chunks = list(create(client, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == scripted.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_a_malformed_call_comes_back_as_content(client, scripted):
    scripted.text = '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "Par\n</tool_call>'
    response = create(client)
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content == scripted.text
    assert response.choices[0].finish_reason == "stop"


def test_tool_calls_and_tool_results_are_rendered_as_the_template_expects(client, scripted):
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_current_weather", "arguments": '{"location": "Paris, France"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]  # fmt: skip
    create(client, messages=messages)
    prompt = scripted.prompts[-1]["prompt"]
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_current_weather", "arguments": {"location": "Paris, France"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n"
        '{"temperature": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    ) in prompt


def post(server, **body):
    return httpx.post(server[0] + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body})


@pytest.mark.parametrize(
    "body, fragment, param",
    [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'", None),
     ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name", None),
     ({"tools": [{"type": "retrieval"}]}, "tools", None),
     ({"tools": [{"type": "function", "function": {"name": "has spaces"}}]}, "name", None),
     ({"tools": [WEATHER, WEATHER]}, "more than once", None),
     ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", None),
     ({"tool_choice": "required"}, "needs at least one tool", None),
     ({"messages": [{"role": "tool", "content": "21"}]}, "tool_call_id", None),
     ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "not valid JSON",
      None)],
)  # fmt: skip
def test_bad_tool_requests_are_400(server, body, fragment, param):
    response = post(server, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"]
    if param:
        assert error["param"] == param


def test_tool_choice_auto_and_none_without_tools_are_accepted(server):
    assert post(server, tool_choice="none").status_code == 200
    assert post(server, tool_choice="auto", tools=[]).status_code == 200


@pytest.mark.parametrize(
    "tool_choice, answer, calls",
    [("required", '[{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}]',
      [("get_time", {"timezone": "Europe/Paris"})]),
     ({"type": "function", "function": {"name": "get_current_weather"}}, '{"location": "Oslo, Norway"}',
      [("get_current_weather", {"location": "Oslo, Norway"})])],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_choice_is_wired_to_structured_outputs(client, scripted, monkeypatch, tool_choice, answer, calls,
                                                           stream):  # fmt: skip
    """tool_choice "required" or a named function: the answer is constrained to the calls' JSON schema
    (structured outputs) and read as calls."""
    from tessera.entrypoints.openai import tools

    scripted.text = answer
    response = create(client, tool_choice=tool_choice, stream=stream)
    if stream:
        found, reasons = {}, []
        for chunk in response:
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    found.setdefault(call.index, ["", ""])
                    found[call.index][0] += call.function.name or ""
                    found[call.index][1] += call.function.arguments or ""
                reasons += [choice.finish_reason] if choice.finish_reason else []
        got = [(name, json.loads(arguments)) for _, (name, arguments) in sorted(found.items())]
    else:
        reasons = [response.choices[0].finish_reason]
        got = [(c.function.name, json.loads(c.function.arguments)) for c in response.choices[0].message.tool_calls]
    assert got == calls and reasons == ["tool_calls"]
    constraint = scripted.params[-1].structured_outputs
    expected = tools.tool_choice_schema(
        [tools.ChatTool.model_validate(t) for t in TOOLS],
        tool_choice if isinstance(tool_choice, str) else tools.NamedToolChoice.model_validate(tool_choice),
    )
    assert constraint.json == expected


def test_offline_chat_renders_tools(tmp_path):
    from tessera.entrypoints.llm import LLM

    llm = LLM(str(build_tiny_qwen2_tools(tmp_path)), kv_cache_memory="16MiB", max_model_len=4096)
    prompt = llm.render_chat(ASK, tools=TOOLS)["prompt"]
    assert json.dumps(WEATHER) in prompt and "<tools>" not in llm.render_chat(ASK)["prompt"]


def test_two_choices_streamed_each_get_their_calls(client, scripted):
    scripted.text = ANSWER
    calls: dict[tuple[int, int], list[str]] = {}
    reasons: dict[int, list[str]] = {0: [], 1: []}
    for chunk in create(client, stream=True, n=2, temperature=1.0):
        assert len({c.index for c in chunk.choices}) == len(chunk.choices)  # one delta per choice per chunk
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault((choice.index, call.index), ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            reasons[choice.index] += [choice.finish_reason] if choice.finish_reason else []
    for i in (0, 1):
        assert [(calls[i, k][0], json.loads(calls[i, k][1])) for k in (0, 1)] == CALLS
        assert reasons[i] == ["tool_calls"]
