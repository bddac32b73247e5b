"""Chat and text completions over the async engine: prompts in, OpenAI-shaped responses out
(whole, or streamed as server-sent events)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Optional

from ...engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from ...engine.chat_utils import ContentFormat, parse_chat_media
from ...engine.engine_client import EngineClient
from ...engine.prompt import check_text_length
from ...errors import InputError
from ...lora.request import LoRARequest
from ...multimodal.embeds import ImageEmbedsRef, decode_image_embeds
from ...multimodal.media import merge_media_io_kwargs
from ...outputs import CompletionOutput, RequestOutput
from .media_loader import AsyncMediaLoader
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest, UnsupportedParameter, error_body
from .tool_parsers import ToolCall, ToolParser
from .tools import constrained_tool_parser, effective_tool_choice, template_tools, tool_choice_schema

logger = logging.getLogger(__name__)


class OpenAIServing:
    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        model_name: str,
        media: AsyncMediaLoader,
        max_images_per_prompt: Optional[int],
        content_format: ContentFormat = "auto",
        media_io_kwargs: Optional[dict[str, Any]] = None,
        tool_parser: Optional[ToolParser] = None,
        enable_mm_embeds: bool = False,
        lora_modules: Optional[dict[str, LoRARequest]] = None,
        enable_prompt_embeds: bool = False,
    ) -> None:
        self.engine = engine
        self.lora_modules = dict(lora_modules or {})  # served adapter name -> its LoRARequest (--lora-modules)
        self.enable_mm_embeds = enable_mm_embeds  # take image_embeds parts (vLLM's --enable-mm-embeds)
        self.enable_prompt_embeds = enable_prompt_embeds  # take completions' prompt_embeds (--enable-prompt-embeds)
        self.tool_parser = tool_parser  # reads tool calls out of answers to requests with tool_choice "auto"
        self.media_io_kwargs = merge_media_io_kwargs(media_io_kwargs)  # the server's; a request's go over them
        self.metrics = metrics
        self.model_name = model_name
        self.media = media
        self.max_images = max_images_per_prompt
        self.content_format = content_format  # how message content reaches the chat template
        self.tokenizer = engine.tokenizer
        self.preprocessor = engine.preprocessor  # renders chats and inline <img> prompts

    # ---- prompts ---------------------------------------------------------------------------------

    def _check_image_count(self, count: int) -> None:
        if self.max_images is not None and count > self.max_images:
            raise InputError(f"This prompt has {count} images; the server takes at most {self.max_images} per prompt.")

    async def chat_prompt(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        media_io_kwargs: Optional[dict[str, Any]] = None,
        tools: Optional[list[dict]] = None,
    ) -> dict:
        # Parse first with the URLs standing in for images and videos: a malformed message, a
        # video for a model without video or too many images is refused before anything is
        # fetched or decoded.
        video_check = self.preprocessor.video_loader(lambda url: url)
        audio_check = self.preprocessor.audio_loader(lambda url: url)
        hf_messages, media, _ = parse_chat_media(
            messages, lambda url: url, self.preprocessor.image_text, load_video=video_check, load_audio=audio_check
        )
        sources, video_urls, audio_urls = media["image"], media["video"], media["audio"]
        embeds = [s for s in sources if isinstance(s, ImageEmbedsRef)]
        if embeds and not self.enable_mm_embeds:
            raise UnsupportedParameter("messages", "image_embeds parts need a server started with --enable-mm-embeds.")
        if any(not isinstance(s, (str, ImageEmbedsRef)) for s in sources):
            raise InputError("Unsupported content part type 'image_pil'; send images as image_url parts.")
        self._check_image_count(len(sources))
        decoded = iter([await asyncio.to_thread(self.preprocessor.decode_image_embeds, ref) for ref in embeds])
        urls = [s for s in sources if isinstance(s, str)]
        video_options = merge_media_io_kwargs(self.media_io_kwargs, media_io_kwargs).get("video", {})
        chars = sum(len(p["text"]) for m in hf_messages for p in _parts(m["content"]) if p["type"] == "text")
        check_text_length(chars, self.preprocessor.max_prompt_chars)  # before rendering megabytes
        results = await asyncio.gather(
            self.media.load_all(urls), self.media.load_all(video_urls, "video", video_options),
            self.media.load_all(audio_urls, "audio"), return_exceptions=True,
        )  # all settled: no load left running behind a failure  # fmt: skip
        for result in results:
            if isinstance(result, BaseException):
                raise result
        images, videos, audios = results
        fetched, loaded_videos, loaded_audios = iter(images), iter(videos), iter(audios)
        loaded = iter([next(fetched) if isinstance(s, str) else next(decoded) for s in sources])  # in part order
        render = functools.partial(
            self.preprocessor.render_chat, add_generation_prompt=add_generation_prompt,
            content_format=self.content_format, load_video=lambda url: next(loaded_videos), tools=tools,
            load_audio=lambda url: next(loaded_audios),
        )  # fmt: skip
        return await asyncio.to_thread(render, messages, lambda url: next(loaded))  # the media, in order

    async def completion_prompt(self, prompt: str | list[int]) -> Any:
        if not isinstance(prompt, str):
            return prompt  # token ids: checked against the vocabulary when processed
        parsed = self.preprocessor.render_inline(prompt, lambda src: src)  # srcs stand in for images
        if "multi_modal_data" in parsed:
            urls = parsed["multi_modal_data"]["image"]
            self._check_image_count(len(urls))
            parsed["multi_modal_data"]["image"] = await self.media.load_all(urls)
        return parsed

    # ---- endpoints -------------------------------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest) -> Any:
        tools = template_tools(request.tools, request.tool_choice)
        choice = effective_tool_choice(request.tools, request.tool_choice)
        parser, schema = None, None
        if tools and choice not in ("auto", "none"):  # "required" or a named function: a constrained answer
            parser = constrained_tool_parser(choice)
            schema = tool_choice_schema(request.tools or [], choice, parallel=request.parallel_tool_calls)
        elif tools and choice == "auto":
            if self.tool_parser is None:
                raise UnsupportedParameter(
                    "tools",
                    'tools with tool_choice "auto" need a tool-call parser, and this server has none '
                    '(start it with --tool-call-parser NAME); leave tools out or send tool_choice "none".',
                )
            parser = self.tool_parser
        prompt = await self.chat_prompt(
            request.messages, request.add_generation_prompt, self._video_io(request), tools=tools
        )
        prompt = with_options(prompt, mm_processor_kwargs=request.mm_processor_kwargs)
        return await self._generate(request, prompt, "chatcmpl", chat=True, tool_parser=parser, constraint=schema)

    def _video_io(self, request: Any) -> Optional[dict[str, Any]]:
        return self.preprocessor.media_io_for(request.media_io_kwargs, request.mm_processor_kwargs)

    async def completion(self, request: CompletionRequest) -> Any:
        if request.prompt_embeds is not None:
            if not self.enable_prompt_embeds:
                raise UnsupportedParameter("prompt_embeds", "prompt_embeds need a server started with "
                                           "--enable-prompt-embeds.")  # fmt: skip
            hidden = self.engine.model_config.hf_config.get_text_config().hidden_size
            embeds = await asyncio.to_thread(decode_image_embeds, request.prompt_embeds, hidden,
                                             self.engine.max_model_len - 1, "prompt_embeds")  # fmt: skip
            return await self._generate(request, {"prompt_embeds": embeds}, "cmpl", chat=False)
        prompt = await self.completion_prompt(request.prompt)
        prompt = with_options(
            prompt, mm_processor_kwargs=request.mm_processor_kwargs, multi_modal_uuids=request.multi_modal_uuids
        )
        return await self._generate(request, prompt, "cmpl", chat=False)

    async def tokenize(self, request: TokenizeRequest) -> dict:
        if request.messages is not None:
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
            prompt = await self.chat_prompt(
                request.messages, request.add_generation_prompt, self._video_io(request), tools=tools or None
            )
        else:
            prompt = await self.completion_prompt(request.prompt or "")
        prompt = with_options(prompt, mm_processor_kwargs=request.mm_processor_kwargs)
        inputs = await self.engine.process(prompt)
        placeholders: dict[str, list[dict]] = {}
        for item in inputs.mm_items:
            placeholders.setdefault(item.modality, []).append({"offset": item.start, "length": item.end - item.start})
        return {
            "count": len(inputs.token_ids),
            "max_model_len": self.engine.max_model_len,
            "tokens": inputs.token_ids,
            "mm_placeholders": placeholders,
        }

    async def _generate(
        self,
        request: Any,
        prompt: Any,
        prefix: str,
        *,
        chat: bool,
        tool_parser: Optional[ToolParser] = None,
        constraint: Optional[dict] = None,
    ) -> Any:
        params = request.to_sampling_params()
        params.lora = self.lora_modules.get(request.model)  # a served adapter's name picks it; else the base model
        if constraint is not None:  # the JSON schema of a forced tool call
            if getattr(params, "structured_outputs", None) is not None:
                raise UnsupportedParameter(
                    "tool_choice", 'tool_choice "required" or a named function cannot be combined with response_format.'
                )
            params = dataclasses.replace(params, structured_outputs={"json": constraint})  # type: ignore[call-arg]
        tools = _ToolCalls(tool_parser, request.parallel_tool_calls) if tool_parser is not None else None
        if tool_parser is not None and tool_parser.needs_special_tokens:
            params.skip_special_tokens = False  # the parser's markers are special tokens
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        stream = await self.engine.add_request(request_id, prompt, params)
        created = int(time.time())
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self._sse(stream, request_id, created, params.n, chat, include_usage, tools)
        final: Optional[RequestOutput] = None
        try:
            async for output in stream:  # cancelled when the client goes away: the stream aborts
                final = output
        except BaseException:
            if final is None or not final.finished:
                self.metrics.count("abort", params.n)
            raise
        assert final is not None
        self.metrics.observe_finished(final)
        choices = [self._choice(c, chat, tools) for c in final.outputs]
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": _usage(final),
        }

    # ---- response shapes -------------------------------------------------------------------------

    def _choice(self, c: CompletionOutput, chat: bool, tools: Optional["_ToolCalls"] = None) -> dict:
        logprobs = self._logprobs(c.token_ids, c.logprobs, chat, 0) if c.logprobs is not None else None
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

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]], chat: bool, text_offset: int) -> Any:
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

    async def _sse(
        self,
        stream: RequestStream,
        request_id: str,
        created: int,
        n: int,
        chat: bool,
        include_usage: bool,
        tools: Optional["_ToolCalls"] = None,
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
                        logprobs = self._logprobs(new_ids, new_lps, chat, sent_text[i])
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
                    yield event([], _usage(final))
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


class _ToolCalls:
    """How a request's answers are read for tool calls: the server's parser, and whether an
    answer may make more than one call (`parallel_tool_calls`)."""

    def __init__(self, parser: ToolParser, parallel: bool) -> None:
        self.parser, self.parallel = parser, parallel


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


def with_options(prompt: Any, **options: Any) -> Any:
    """The engine prompt with the request's prompt-level options (those given) added."""
    options = {key: value for key, value in options.items() if value is not None}
    if not options:
        return prompt
    if not isinstance(prompt, dict):  # token ids
        prompt = {"prompt_token_ids": prompt}
    return {**prompt, **options}


def _parts(content: Any) -> list[dict]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _usage(output: RequestOutput) -> dict:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
