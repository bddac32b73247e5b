"""`/v1/responses`: OpenAI's Responses API over the chat machinery. A request's `input` (a string, or message items
with `input_text` / `input_image` parts, earlier `function_call` items and their `function_call_output`s) and
`instructions` become chat messages; `tools` (flat function tools), `tool_choice`, `text.format` (json_schema,
json_object) and the sampling fields become a chat completion request, which runs as `/v1/chat/completions` does.
Its answer comes back as a `response` object (`message` items with `output_text` parts, `function_call` items),
or, streamed, as the typed events the SDKs read (`response.created` ... `response.output_text.delta` ...
`response.completed`). Nothing is stored: `previous_response_id` is refused, the conversation is sent whole."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .protocol import ChatCompletionRequest, RequestMediaIOKwargs, RequestProcessorKwargs, UnsupportedParameter
from .serving import OpenAIServing


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    text: Optional[dict[str, Any]] = None  # {"format": {"type": "text" | "json_schema" | "json_object", ...}}
    previous_response_id: Optional[str] = None
    store: Optional[bool] = None  # nothing is stored either way
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    seed: Optional[int] = None  # vLLM's extensions
    top_k: Optional[int] = None
    mm_processor_kwargs: RequestProcessorKwargs = None
    media_io_kwargs: RequestMediaIOKwargs = None

    @model_validator(mode="after")
    def _check(self) -> "ResponsesRequest":
        if self.previous_response_id is not None:
            raise UnsupportedParameter("previous_response_id", "This server stores no responses: send the whole "
                                       "conversation as input items instead of previous_response_id.")  # fmt: skip
        return self

    def to_chat_request(self) -> ChatCompletionRequest:
        """The chat completion request that answers this one."""
        fields: dict[str, Any] = {
            "model": self.model, "messages": self._messages(), "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream, "seed": self.seed,
            "top_k": self.top_k, "parallel_tool_calls": self.parallel_tool_calls,
            "mm_processor_kwargs": self.mm_processor_kwargs, "media_io_kwargs": self.media_io_kwargs,
        }  # fmt: skip
        if self.stream:
            fields["stream_options"] = {"include_usage": True}
        if self.tools:
            fields["tools"] = [_chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = _chat_tool_choice(self.tool_choice)
        text_format = (self.text or {}).get("format") or {"type": "text"}
        if text_format.get("type") == "json_schema":
            schema = {k: text_format[k] for k in ("name", "schema", "strict", "description") if k in text_format}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif text_format.get("type") == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif text_format.get("type") != "text":
            raise UnsupportedParameter("text", f"text.format type {text_format.get('type')!r} is not supported.")
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for item in self.input:
            kind = item.get("type", "message")
            if kind == "message":
                role = "system" if item.get("role") == "developer" else item.get("role")
                content = item.get("content")
                parts = content if isinstance(content, str) else [_chat_part(part) for part in content or []]
                messages.append({"role": role, "content": parts})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}  # fmt: skip
                if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
            else:
                raise UnsupportedParameter("input", f"input items of type {kind!r} are not supported.")
        return messages


def _chat_part(part: dict[str, Any]) -> dict[str, Any]:
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    if kind == "input_image":
        if not part.get("image_url"):
            raise UnsupportedParameter("input", "input_image needs an image_url (file ids are not supported).")
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    raise UnsupportedParameter("input", f"content parts of type {kind!r} are not supported.")


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise UnsupportedParameter("tools", f"tools of type {tool.get('type')!r} are not supported; only functions.")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Union[str, dict[str, Any]]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not choice.get("name"):
        raise UnsupportedParameter("tool_choice", "tool_choice must be none, auto, required or a named function.")
    return {"type": "function", "function": {"name": choice["name"]}}


class OpenAIServingResponses:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, request: ResponsesRequest) -> Any:
        chat = request.to_chat_request()
        response_id, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        answer = await self.serving.chat(chat)
        if isinstance(answer, dict):
            (choice,) = answer["choices"]
            output = _output_items(choice["message"].get("content"), choice["message"].get("tool_calls") or [])
            return _response(
                request,
                response_id,
                created,
                output,
                choice["finish_reason"],
                answer["usage"],
                model=self.serving.model_name,
            )
        return self._events(request, response_id, created, answer)

    async def _events(self, request: ResponsesRequest, response_id: str, created: int, chunks: AsyncIterator[str]):
        """The Responses stream from the chat completion chunks: the message's text as it comes, the tool calls
        once complete, then `response.completed` with the whole response."""
        sequence = iter(range(1 << 30))

        def event(kind: str, **body: Any) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(sequence), **body})}\n\n"

        model = self.serving.model_name
        shell = _response(request, response_id, created, [], None, None, status="in_progress", model=model)
        yield event("response.created", response=shell)
        yield event("response.in_progress", response=shell)
        message_id, text, calls, reason, usage, opened = f"msg_{uuid.uuid4().hex}", "", {}, None, None, False
        async for chunk in chunks:
            if not chunk.startswith("data: {"):
                continue
            body = json.loads(chunk[len("data: ") :])
            usage = body.get("usage") or usage
            for choice in body.get("choices", []):
                delta, reason = choice.get("delta", {}), choice.get("finish_reason") or reason
                for call in delta.get("tool_calls") or []:
                    entry = calls.setdefault(call["index"], {"id": call.get("id"), "name": "", "arguments": ""})
                    entry["name"] += (call.get("function") or {}).get("name") or ""
                    entry["arguments"] += (call.get("function") or {}).get("arguments") or ""
                piece = delta.get("content") or ""
                if piece and not opened:
                    opened = True
                    item = {"type": "message", "id": message_id, "status": "in_progress", "role": "assistant",
                            "content": []}  # fmt: skip
                    yield event("response.output_item.added", output_index=0, item=item)
                    yield event("response.content_part.added", item_id=message_id, output_index=0, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": []})  # fmt: skip
                if piece:
                    text += piece
                    yield event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0,
                                delta=piece, logprobs=[])  # fmt: skip
        finished = [{"id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for _, c in sorted(calls.items())]  # fmt: skip
        output = _output_items(text if opened else None, finished, message_id)
        if opened:
            part = output[0]["content"][0]
            yield event("response.output_text.done", item_id=message_id, output_index=0, content_index=0, text=text,
                        logprobs=[])  # fmt: skip
            yield event("response.content_part.done", item_id=message_id, output_index=0, content_index=0, part=part)
            yield event("response.output_item.done", output_index=0, item=output[0])
        for index, item in enumerate(output[1 if opened else 0 :], start=1 if opened else 0):
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])  # fmt: skip
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"])  # fmt: skip
            yield event("response.output_item.done", output_index=index, item=item)
        final = _response(request, response_id, created, output, reason, usage, model=model)
        yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)


def _output_items(text: Optional[str], tool_calls: list[dict], message_id: Optional[str] = None) -> list[dict]:
    """A `message` item with the answer's text (when it has any), then one `function_call` item per call."""
    items: list[dict] = []
    if text:
        items.append({"type": "message", "id": message_id or f"msg_{uuid.uuid4().hex}", "status": "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": text, "annotations": []}]})  # fmt: skip
    for call in tool_calls:
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})  # fmt: skip
    return items


def _response(request: ResponsesRequest, response_id: str, created: int, output: list[dict],
              finish_reason: Optional[str], usage: Optional[dict], status: Optional[str] = None,
              model: Optional[str] = None) -> dict:  # fmt: skip
    """OpenAI's `response` object; a length-cut answer is "incomplete" (max_output_tokens)."""
    incomplete = finish_reason == "length"
    usage = usage or {}
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model or request.model,
        "status": status or ("incomplete" if incomplete else "completed"),
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete and not status else None,
        "error": None, "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "output": output, "parallel_tool_calls": request.parallel_tool_calls,
        "temperature": request.temperature, "top_p": request.top_p, "tools": request.tools or [],
        "tool_choice": request.tool_choice or "auto", "text": request.text or {"format": {"type": "text"}},
        "metadata": request.metadata or {}, "store": False, "previous_response_id": None,
        "usage": None if not usage else {
            "input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
            "total_tokens": usage.get("total_tokens", 0), "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }  # fmt: skip
