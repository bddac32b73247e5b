"""Chat and text completions over the async engine: prompts in, OpenAI-shaped responses out
(whole, or streamed as server-sent events: ``response_writer.py`` shapes them)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from typing import Any, Optional

from ...engine.chat_utils import ContentFormat, parse_chat_media
from ...engine.engine_client import EngineClient
from ...engine.prompt import check_text_length
from ...errors import InputError
from ...lora.request import LoRARequest
from ...multimodal.embeds import ImageEmbedsRef, decode_image_embeds
from ...multimodal.media import merge_media_io_kwargs
from ...outputs import RequestOutput
from .media_loader import AsyncMediaLoader
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest, UnsupportedParameter
from .response_writer import ResponseWriter, ToolCalls, usage
from .tool_parsers import ToolParser
from .tools import constrained_tool_parser, effective_tool_choice, template_tools, tool_choice_schema


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
        self.responses = ResponseWriter(self.tokenizer, model_name, metrics)

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
        tools = ToolCalls(tool_parser, request.parallel_tool_calls) if tool_parser is not None else None
        if tool_parser is not None and tool_parser.needs_special_tokens:
            params.skip_special_tokens = False  # the parser's markers are special tokens
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        stream = await self.engine.add_request(request_id, prompt, params)
        created = int(time.time())
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self.responses.sse(stream, request_id, created, params.n, chat, include_usage, tools)
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
        choices = [self.responses.choice(c, chat, tools) for c in final.outputs]
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage(final),
        }


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
