"""The OpenAI-compatible HTTP server (FastAPI) and the web chat page, over one shared engine.

tessera serve --model FOLDER --port 8000
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import itertools
import logging
import signal
import threading
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Optional, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...config import engine_option_names
from ...engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from ...engine.engine_client import EngineClient
from ...errors import ServerBusyError
from ...lora.request import LoRARequest
from ...multimodal.media import MediaPolicy
from .body_limit import BodySizeLimit
from .http_server import GracefulServer, ServerThread, uvicorn_config
from .media_loader import AsyncMediaLoader
from .metrics import ServerMetrics
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    UnsupportedParameter,
    check_adapter_folder,
    error_body,
)
from .serving import OpenAIServing
from .serving_embedding import OpenAIServingEmbedding
from .serving_responses import OpenAIServingResponses, ResponsesRequest
from .serving_score import OpenAIServingScore, RerankRequest, ScoreRequest
from .serving_transcription import OpenAIServingTranscription, transcription_request
from .tool_parsers import default_tool_parser, get_tool_parser

logger = logging.getLogger(__name__)
WEB_DIR = Path(__file__).resolve().parents[1] / "web"
PROTECTED_PREFIXES = ("/v1/", "/v2/", "/tokenize", "/score", "/rerank")
T = TypeVar("T")
__all__ = ["build_app", "serve", "ServerThread"]


def build_app(
    engine: EngineClient,
    *,
    model_name: str,
    api_key: Optional[str] = None,
    media_policy: Optional[MediaPolicy] = None,
    max_images_per_prompt: Optional[int] = None,
    max_request_bytes: int = 32 * 2**20,
    max_concurrent_fetches: int = 16,
    chat_template_content_format: str = "auto",
    allowed_media_dir: Optional[str] = None,
    image_fetch_timeout: Optional[float] = None,
    image_fetch_max_bytes: Optional[int] = None,
    media_io_kwargs: Optional[dict[str, Any]] = None,
    tool_call_parser: Optional[str] = None,
    enable_mm_embeds: bool = False,
    lora_modules: Optional[dict[str, str]] = None,
    allow_runtime_lora_updating: bool = False,
    enable_prompt_embeds: bool = False,
) -> FastAPI:
    """The app for a running engine (an `AsyncEngine`); `api_key` guards /v1/* and /tokenize. The default media
    policy fetches public http(s) URLs and reads no local files; `allowed_media_dir`,
    `image_fetch_timeout` and `image_fetch_max_bytes` (the options before MediaPolicy) adjust it.
    `media_io_kwargs` ({"video": {"num_frames": N, "fps": F}}): how videos are sampled unless a
    request's own say otherwise. `tool_call_parser` (vLLM's --tool-call-parser: "hermes",
    "llama3_json", "mistral") reads tool calls out of answers to requests with tools; None: "hermes"
    when the model's chat template writes `<tool_call>`, else none (such requests are refused).
    `enable_mm_embeds`: take precomputed `image_embeds` chat parts (checked: multimodal/embeds.py).
    `lora_modules` ({name: PEFT adapter folder}, vLLM's --lora-modules): a request whose `model` is one of the
    names runs with that adapter (loaded on first use); `allow_runtime_lora_updating` opens
    /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    media_policy = media_policy or MediaPolicy(fetch_urls=True)
    legacy = {
        "allowed_local_dir": allowed_media_dir,
        "timeout": image_fetch_timeout,
        "max_bytes": image_fetch_max_bytes,
    }
    media_policy = dataclasses.replace(media_policy, **{k: v for k, v in legacy.items() if v is not None})
    app = FastAPI(title="Tessera", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(engine, model_name)
    media = AsyncMediaLoader(media_policy, max_concurrent_fetches=max_concurrent_fetches)
    if chat_template_content_format not in ("auto", "string", "openai"):
        raise ValueError(
            f"chat_template_content_format must be auto, string or openai, got {chat_template_content_format!r}"
        )
    if tool_call_parser is not None:
        parser = get_tool_parser(tool_call_parser)
    else:
        parser = default_tool_parser(engine.chat_template)
    adapters = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate((lora_modules or {}).items())}
    adapter_ids = itertools.count(len(adapters) + 1)  # an id is never reused: the engine keys caches by it
    serving = OpenAIServing(engine, metrics, model_name, media, max_images_per_prompt, chat_template_content_format,
                            media_io_kwargs, tool_parser=parser, enable_mm_embeds=enable_mm_embeds,
                            lora_modules=adapters, enable_prompt_embeds=enable_prompt_embeds)  # fmt: skip
    transcriptions = OpenAIServingTranscription(engine, metrics, media)
    embeddings = OpenAIServingEmbedding(serving, model_name)
    responses = OpenAIServingResponses(serving)
    scoring = OpenAIServingScore(embeddings)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving
    model_path = str(engine.model_config.model)

    def error(status: int, message: str, kind: str = "invalid_request_error", param: Optional[str] = None):
        if status in (400, 413):
            metrics.count("error")
        return JSONResponse(error_body(message, kind, status, param), status_code=status)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):  # type: ignore[no-untyped-def]
        if api_key is not None and request.url.path.startswith(PROTECTED_PREFIXES):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error(
                    401, "Missing or wrong API key; send 'Authorization: Bearer <key>'.", "authentication_error"
                )
        return await call_next(request)

    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, e: RequestValidationError) -> JSONResponse:
        problems, param = [], None
        for err in e.errors():
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, UnsupportedParameter):
                param = param or cause.param
                problems.append(str(cause))
                continue
            where = ".".join(str(x) for x in err["loc"] if x != "body") or "body"
            problems.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
        return error(400, f"Invalid request: {'; '.join(problems)}", param=param)

    @app.exception_handler(ValueError)
    async def bad_input(_: Request, e: ValueError) -> JSONResponse:
        return error(getattr(e, "status_code", 400), str(e), param=getattr(e, "param", None))

    @app.exception_handler(ServerBusyError)
    async def busy(_: Request, e: ServerBusyError) -> JSONResponse:
        return error(503, str(e), "server_error")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error(503, str(e), "server_error")

    @app.exception_handler(RequestFailedError)
    async def request_failed(_: Request, e: RequestFailedError) -> JSONResponse:
        return error(e.status_code, str(e), "server_error" if e.status_code >= 500 else "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:  # a bug: details to the log only
        logger.error("Unhandled error", exc_info=e)
        return error(500, "Internal server error.", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error(
            e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error"
        )

    def check_model(name: Optional[str]) -> None:
        if name not in (None, model_name, model_path, *adapters):
            raise StarletteHTTPException(404, f"The model {name!r} does not exist; this server serves {model_name!r}.")

    async def respond(raw: Request, work: Awaitable[Any]) -> Response:
        """The JSON or event-stream response of `work`; a client that leaves first cancels it (and
        so aborts its request) instead of leaving it to generate for nobody."""
        result = await until_disconnected(raw, work)
        if result is None:
            return Response(status_code=499)  # nobody reads this
        if isinstance(result, dict):
            return JSONResponse(result)
        if isinstance(result, str):
            return PlainTextResponse(result)
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        check_model(request.model)
        return await respond(raw, serving.chat(request))

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        check_model(request.model)
        return await respond(raw, serving.completion(request))

    @app.post("/v1/audio/transcriptions")
    async def audio_transcriptions(raw: Request) -> Response:
        async with raw.form(max_files=1, max_fields=64) as form:
            request, upload = transcription_request(form)
            check_model(request.model)
            data = await upload.read()
        return await respond(raw, transcriptions.transcribe(request, data))

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw: Request) -> Response:
        check_model(request.model)
        return await respond(raw, responses.create(request))

    @app.post("/v1/embeddings")
    async def create_embeddings(request: EmbeddingRequest, raw: Request) -> Response:
        check_model(request.model)
        return await respond(raw, embeddings.embed(request))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(request: ScoreRequest, raw: Request) -> Response:
        check_model(request.model)
        return await respond(raw, scoring.score(request))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(request: RerankRequest, raw: Request) -> Response:
        check_model(request.model)
        return await respond(raw, scoring.rerank(request))

    runtime_off = "Adapters are fixed at start; start the server with --allow-runtime-lora-updating to change them."

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        if not allow_runtime_lora_updating:
            return error(400, runtime_off)
        if request.lora_name in adapters or request.lora_name in (model_name, model_path):
            return error(400, f"The name {request.lora_name!r} is already served.", param="lora_name")
        check_adapter_folder(request.lora_name, request.lora_path)
        adapters[request.lora_name] = LoRARequest(request.lora_name, next(adapter_ids), request.lora_path)
        serving.lora_modules[request.lora_name] = adapters[request.lora_name]
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        if not allow_runtime_lora_updating:
            return error(400, runtime_off)
        if adapters.pop(request.lora_name, None) is None:
            return error(404, f"No adapter named {request.lora_name!r} is served.", "not_found_error", "lora_name")
        serving.lora_modules.pop(request.lora_name, None)  # its weights go when the engine needs the slot
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest, raw: Request) -> Response:
        check_model(request.model)
        return await respond(raw, serving.tokenize(request))

    created = int(time.time())

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "tessera", "root": model_path,
                "max_model_len": engine.max_model_len}  # fmt: skip
        cards = [card] + [{**card, "id": name, "root": lora.lora_path, "parent": model_name}
                          for name, lora in adapters.items()]  # fmt: skip
        return {"object": "list", "data": cards}

    @app.get("/health")
    async def health() -> Response:
        if engine.is_alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "dead", "error": "The engine stopped; the server is exiting."}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
    app.router.add_event_handler("shutdown", media.shutdown)
    return app


async def until_disconnected(raw: Request, work: Awaitable[T]) -> Optional[T]:
    """`work`'s result, or None (with `work` cancelled) if the client disconnects first. The
    request body has been read by then, so the next ASGI message can only be the disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return None
    return task.result()


SHUTDOWN_TIMEOUT = 5.0  # seconds running requests get to finish after SIGTERM (--shutdown-timeout)
SHUTDOWN_FLUSH = 5.0  # seconds more for the ended ones' last events to reach their clients


def serve(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: Optional[str] = None,
    log_level: str = "info",
    head_timeout: float = 10.0,
    data_parallel_size: int = 1,
    shutdown_timeout: float = SHUTDOWN_TIMEOUT,
    **app_options: Any,
) -> int:
    """Load the model, start the engine thread and serve until interrupted. Returns the exit
    status: 1 if the engine died (so a supervisor restarts the server), else 0. With
    `data_parallel_size` N > 1: N engine replicas, each in a process of its own with the same engine
    options, requests routed by their first image (docs/parallelism.md).

    On SIGTERM (or Ctrl-C) the server stops accepting connections, lets running requests finish for up to
    `shutdown_timeout` seconds, then ends the rest (a stream gets a final error event and [DONE], a whole
    response a 503) and exits with status 0."""
    from ...engine.llm_engine import LLMEngine

    engine_names = engine_option_names()  # the options that configure the engine; the rest configure the app
    engine_options = {k: app_options.pop(k) for k in list(app_options) if k in engine_names}
    if app_options.get("max_images_per_prompt") is not None:
        engine_options["limit_mm_per_prompt"] = {"image": app_options["max_images_per_prompt"]}
    if data_parallel_size != 1:
        engine = AsyncEngine(LLMEngine.data_parallel(model, engine_options, data_parallel_size))
    else:
        engine = AsyncEngine(LLMEngine.from_options(model, **engine_options))
    app = build_app(engine, model_name=served_model_name or Path(model).name, **app_options)
    config = uvicorn_config(app, host=host, port=port, log_level=log_level, head_timeout=head_timeout,
                            timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_FLUSH)  # fmt: skip
    message = f"The server is shutting down; this request did not finish within {shutdown_timeout:g} s."
    server = GracefulServer(config, drain_timeout=shutdown_timeout, end_requests=lambda: engine.abort_all(message))

    def exit_on_engine_death(error: BaseException) -> None:
        logger.error("The engine died (%r); stopping the server so that it can be restarted", error)
        server.should_exit = True

    engine.on_dead.append(exit_on_engine_death)
    # uvicorn raises the signal it shut down on again once it has stopped: handled here, so that the engine is
    # shut down below (tensor-parallel workers, replicas) and the exit status says how it went.
    handled = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
    previous = {sig: signal.signal(sig, _stopped) for sig in handled}
    try:
        server.run()
    finally:
        engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if engine.dead is not None else 0


def _stopped(sig: int, frame: Any) -> None:
    """The signal uvicorn re-raises after its graceful shutdown: already handled."""
