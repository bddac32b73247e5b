"""/v1/responses through the official openai client on the demo server: an image question answers as the same
chat completion does, whole and streamed (the deltas add up to the final text, the events in the SDK's order);
instructions act as a system message; text.format json_schema constrains the answer; a forced function call
comes back as a function_call item and its output goes back in as an input item; a cut answer is "incomplete";
what is not supported gets a 400 naming it."""

from __future__ import annotations

import json

import httpx
import pytest
from PIL import Image

from testkit.server import API_KEY, data_url

QUESTION = "What colour is the circle?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",  # (the tiny model's
           "parameters": {"type": "object", "required": ["city"],  # own strings never end: an enum ends them)
                          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}  # fmt: skip


@pytest.fixture(scope="module")
def image_url(tmp_path_factory):
    path = tmp_path_factory.mktemp("responses") / "circle.png"
    image = Image.new("RGB", (64, 64), "white")
    image.paste((220, 30, 30), (16, 16, 48, 48))
    image.save(path)
    return data_url(path)


def chat_text(client, messages, **options) -> str:
    reply = client.chat.completions.create(model="demo", messages=messages, temperature=0, **options)
    return reply.choices[0].message.content


def test_an_image_question_answers_as_chat_does_whole_and_streamed(client, image_url):
    content = [{"type": "input_image", "image_url": image_url}, {"type": "input_text", "text": QUESTION}]
    response = client.responses.create(model="demo", input=[{"role": "user", "content": content}],
                                       max_output_tokens=12, temperature=0)  # fmt: skip
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                         {"type": "text", "text": QUESTION}]}]  # fmt: skip
    expected = chat_text(client, chat, max_tokens=12)
    assert response.output_text == expected and response.object == "response" and response.model == "demo"
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    events = list(client.responses.create(model="demo", input=[{"role": "user", "content": content}],
                                          max_output_tokens=12, temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected == events[-1].response.output_text


def test_instructions_are_the_system_message(client):
    response = client.responses.create(model="demo", instructions="Answer in one word.", input="Hello there",
                                       max_output_tokens=8, temperature=0)  # fmt: skip
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hello there"}]
    assert response.output_text == chat_text(client, messages, max_tokens=8)


def test_a_json_schema_text_format_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}  # fmt: skip
    response = client.responses.create(
        model="demo", input="Which colour?", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert json.loads(response.output_text)["colour"] in ("red", "blue")


def test_a_forced_function_call_and_its_output_going_back(client):
    response = client.responses.create(model="demo", input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       max_output_tokens=60, temperature=0)  # fmt: skip
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    follow_up = client.responses.create(
        model="demo", max_output_tokens=8, temperature=0, tools=[WEATHER], tool_choice="none",
        input=[{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )  # fmt: skip
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]  # fmt: skip
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    assert follow_up.output_text == chat_text(client, messages, max_tokens=8, tools=[chat_tool], tool_choice="none")


def test_a_cut_answer_is_incomplete(client):
    response = client.responses.create(model="demo", input="Tell me a long story", max_output_tokens=2, temperature=0,
                                       extra_body={"top_k": 1})  # fmt: skip
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input_file"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "web_search"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ],
)
def test_what_is_not_supported_gets_a_400_naming_it(server, body, fragment):
    url, _ = server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(url + "/v1/responses", json={"model": "demo", **body}, headers=headers, timeout=60)
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]
