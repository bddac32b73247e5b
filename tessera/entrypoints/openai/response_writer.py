"""OpenAI's response shapes for chat and text completions: a whole answer's choices, usage and logprobs, or the
answer streamed as server-sent events (tool calls read out of it as it streams)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Optional

from ...engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from ...outputs import CompletionOutput, RequestOutput
from .metrics import ServerMetrics
from .protocol import error_body
from .tool_parsers import ToolCall, ToolParser

logger = logging.getLogger(__name__)


class ToolCalls:
    """How a request's answers are read for tool calls: the server's parser, and whether an
    answer may make more than one call (`parallel_tool_calls`)."""

    def __init__(self, parser: ToolParser, parallel: bool) -> None:
        self.parser, self.parallel = parser, parallel


class ResponseWriter:
    """Engine outputs -> OpenAI's choices and events, for one served model."""

    def __init__(self, tokenizer: Any, model_name: str, metrics: ServerMetrics) -> None:
        self.tokenizer, self.model_name, self.metrics = tokenizer, model_name, metrics

    def choice(self, c: CompletionOutput, chat: bool, tools: Optional["ToolCalls"] = None) -> dict:
        logprobs = self.logprobs(c.token_ids, c.logprobs, chat, 0) if c.logprobs is not None else None
        if chat and tools is not None:
            found = tools.parser.extract(c.text)
            calls = found.calls[:1] if found.calls and not tools.parallel else found.calls
            message: dict[str, Any] = {"role": "assistant", "content": found.content}
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
            reason = _finish_reason(c.finish_reason, bool(calls))
            return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": reason}
        if chat:
            message = {"role": "assistant", "content": c.text}
            return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason}
        return {"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], chat: bool, text_offset: int) -> Any:
        """OpenAI's logprobs object for these tokens: chat {"content": [...]}, completions the
        parallel lists tokens / token_logprobs / top_logprobs / text_offset."""
        entries = []
        for token_id, table in zip(token_ids, logprobs):
            token = self.tokenizer.decode([token_id])
            top = sorted(table.items(), key=lambda kv: -kv[1])
            entries.append(
                (token, table.get(token_id, float("-inf")), [(self.tokenizer.decode([t]), lp) for t, lp in top])
            )
        if chat:

            def item(token: str, lp: float) -> dict:  # fmt: skip
                return {"token": token, "logprob": lp, "bytes": list(token.encode())}

            return {"content": [{**item(t, lp), "top_logprobs": [item(*x) for x in top]} for t, lp, top in entries]}
        offsets, position = [], text_offset
        for token, _, _ in entries:
            offsets.append(position)
            position += len(token)
        return {
            "tokens": [t for t, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries],
            "text_offset": offsets,
        }

    async def sse(
        self,
        stream: RequestStream,
        request_id: str,
        created: int,
        n: int,
        chat: bool,
        include_usage: bool,
        tools: Optional["ToolCalls"] = None,
    ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict], usage: Optional[dict] = None) -> str:
            body = {"id": request_id, "object": kind, "created": created, "model": self.model_name, "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        sent_text, sent_tokens, done = [0] * n, [0] * n, [False] * n
        streams = [tools.parser.stream() for _ in range(n)] if tools is not None else None
        calls_sent = [0] * n
        final: Optional[RequestOutput] = None
        try:
            if chat:
                first = {"role": "assistant", "content": ""}
                yield event([{"index": i, "delta": first, "logprobs": None, "finish_reason": None} for i in range(n)])
            async for output in stream:
                final = output
                choices = []
                for c in output.outputs:
                    i = c.index
                    if done[i]:
                        continue
                    text, new_ids = c.text[sent_text[i] :], c.token_ids[sent_tokens[i] :]
                    if not text and not c.finished:
                        continue  # e.g. a token held back while it might start a stop string
                    logprobs = None
                    if c.logprobs is not None:
                        new_lps = c.logprobs[sent_tokens[i] :]
                        logprobs = self.logprobs(new_ids, new_lps, chat, sent_text[i])
                    sent_text[i], sent_tokens[i], done[i] = len(c.text), len(c.token_ids), c.finished
                    reason = c.finish_reason if c.finished else None
                    if streams is not None:  # chat with a tool-call parser: content and call deltas
                        deltas = _tool_deltas(streams[i].feed(c.text, c.finished), calls_sent, i, tools.parallel)
                        if c.finished:
                            reason = _finish_reason(reason, calls_sent[i] > 0)
                        if not deltas and (reason or logprobs is not None):
                            deltas = [{}]
                        for k, delta in enumerate(deltas):  # the first carries the logprobs, the last the reason
                            choices.append({"index": i, "delta": delta, "logprobs": logprobs if k == 0 else None,
                                            "finish_reason": reason if k == len(deltas) - 1 else None})  # fmt: skip
                    elif chat:
                        delta = {"content": text} if text else {}
                        choices.append({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
                    else:
                        choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason})
                for batch in _one_per_choice(choices):
                    yield event(batch)
            if final is not None and final.finished:
                self.metrics.observe_finished(final)
                if include_usage:
                    yield event([], usage(final))
        except Exception as e:  # the engine failed under this request: tell the client in-band
            status = 503 if isinstance(e, EngineDeadError) else getattr(e, "status_code", 500)
            if not isinstance(e, (EngineDeadError, RequestFailedError)):
                logger.exception("Streaming %s failed", request_id)
            message = str(e) if status == 503 or isinstance(e, RequestFailedError) else "Internal server error."
            kind = "server_error" if status >= 500 else "invalid_request_error"
            yield f"data: {json.dumps(error_body(message, kind, status))}\n\n"
        finally:
            if final is None or not final.finished:  # the client went away: free the request now
                stream.abort()
                self.metrics.count("abort", n)
        yield "data: [DONE]\n\n"


def _finish_reason(reason: Optional[str], called: bool) -> Optional[str]:
    """OpenAI's "tool_calls" for an answer that stopped after making calls."""
    return "tool_calls" if called and reason == "stop" else reason


def _tool_deltas(events: list[Any], calls_sent: list[int], i: int, parallel: bool) -> list[dict]:
    """OpenAI's chat deltas for a tool-call stream's events: content as {"content"}, and each call
    as two deltas, its index, id, type and name first, then its arguments (whole: a call is sent
    once it is complete). Without parallel calls, calls after the first are dropped."""
    deltas: list[dict] = []
    for event in events:
        if isinstance(event, str):
            deltas.append({"content": event})
            continue
        assert isinstance(event, ToolCall)
        if calls_sent[i] and not parallel:
            continue
        index = calls_sent[i]
        calls_sent[i] += 1
        head = {"index": index, "id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}}
        deltas.append({"tool_calls": [head]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": event.arguments}}]})
    return deltas


def _one_per_choice(choices: list[dict]) -> list[list[dict]]:
    """The choices as events that each hold at most one delta per choice, in order."""
    batches: list[list[dict]] = []
    seen: list[set[int]] = []
    for choice in choices:
        for batch, indexes in zip(batches, seen):
            if choice["index"] not in indexes and all(c["index"] < choice["index"] for c in batch[-1:]):
                batch.append(choice)
                indexes.add(choice["index"])
                break
        else:
            batches.append([choice])
            seen.append({choice["index"]})
    return batches


def usage(output: RequestOutput) -> dict:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
