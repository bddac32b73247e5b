"""Structured outputs through the server with the official `openai` client, on the demo model:
`response_format` json_schema (streamed and not) gives JSON valid for the schema, json_object starts
an object, vLLM's guided_choice / guided_regex / guided_grammar / structured_outputs hold, an invalid
schema or a malformed / ambiguous constraint is a 400 naming its parameter, and {"type": "text"} is off."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from testkit.server import API_KEY

SCHEMA = {
    "type": "object",
    "properties": {
        "shape": {"enum": ["circle", "square", "triangle"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "label": {"type": "string", "maxLength": 10},
    },
    "required": ["shape", "count", "label"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe the shapes as JSON."}]


def check_schema(value) -> None:
    assert isinstance(value, dict) and set(value) == {"shape", "count", "label"}
    assert value["shape"] in ("circle", "square", "triangle")
    assert type(value["count"]) is int and 0 <= value["count"] <= 9
    assert isinstance(value["label"], str) and len(value["label"]) <= 10


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)


def json_schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "shapes", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 0), (1.0, 1)])
def test_json_schema_returns_valid_json(client, temperature, seed):
    response = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=60, temperature=temperature, seed=seed,
        response_format=json_schema_format(),
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    check_schema(json.loads(choice.message.content))


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_streamed_returns_valid_json(client, seed):
    stream = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=seed,
        response_format=json_schema_format(), stream=True,
    )  # fmt: skip
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    check_schema(json.loads("".join(parts)))


def test_json_object_starts_an_object(client):
    response = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=30, temperature=1.0, seed=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    content = response.choices[0].message.content
    assert content.startswith("{")
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_text_response_format_is_unconstrained(client):
    plain = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8, temperature=0)
    text = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=8, temperature=0, response_format={"type": "text"}
    )
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_guided_choice_in_chat_and_completions(client):
    choices = ["red circle", "blue square", "none"]
    chat = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=10, temperature=1.0, seed=3, extra_body={"guided_choice": choices}
    )
    assert chat.choices[0].message.content in choices
    # room for the longest choice spelled a character a token (11) and the stop token; seeded, so never flaky
    completion = client.completions.create(
        model="demo", prompt="The picture shows", max_tokens=16, seed=0,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert completion.choices[0].text in choices and completion.choices[0].finish_reason == "stop"


def test_guided_regex_and_grammar_fully_match(client):
    pattern = r"\d{3}-[a-z]{2}"
    regex = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=0, extra_body={"guided_regex": pattern}
    )
    assert re.fullmatch(pattern, regex.choices[0].message.content)
    grammar = 'root ::= ("yes" | "no") "!"'
    answer = client.completions.create(
        model="demo", prompt="Is it red?", max_tokens=8, extra_body={"guided_grammar": grammar}
    )
    assert answer.choices[0].text in ("yes!", "no!")


def test_guided_json_with_several_outputs(client):
    response = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=60, temperature=1.0, seed=4, n=2, extra_body={"guided_json": SCHEMA}
    )
    assert len(response.choices) == 2
    for choice in response.choices:
        check_schema(json.loads(choice.message.content))


def post(server, body):
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 8, **body}
    return httpx.post(
        server[0] + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"response_format": json_schema_format({"type": "frobnicate"})}, None, "Invalid structured output"),
        ({"guided_regex": "a(b"}, None, "regex"),
        ({"guided_grammar": "root ::= nothing_defined"}, None, "grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
        ({"guided_choice": []}, "guided_choice", "choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format", "only one"),
    ],
)
def test_an_invalid_constraint_is_a_400(server, body, param, fragment):
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param
    assert post(server, {"guided_choice": ["ok"]}).json()["choices"][0]["message"]["content"] == "ok"  # serving on


SHAPE_TOOL = {
    "type": "function",
    "function": {
        "name": "count_shapes",
        "description": "Record how many shapes of a kind the picture has.",
        "parameters": {
            "type": "object",
            "properties": {"shape": {"enum": ["circle", "square"]}, "count": {"type": "integer", "maximum": 9}},
            "required": ["shape", "count"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "count_shapes"}}, "required"])
def test_a_forced_tool_choice_always_returns_a_parseable_call(client, tool_choice):
    """A named function or "required" (one call: parallel_tool_calls false) is enforced by structured outputs:
    the demo model, which knows nothing of tools, still answers with a call whose arguments parse and fit
    the function's parameters."""
    for seed in range(3):
        reply = client.chat.completions.create(
            model="demo", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=seed,
            tools=[SHAPE_TOOL], tool_choice=tool_choice, parallel_tool_calls=False,
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls[:1]
        assert call.function.name == "count_shapes" and call.id
        arguments = json.loads(call.function.arguments)
        assert arguments["shape"] in ("circle", "square") and type(arguments["count"]) is int
