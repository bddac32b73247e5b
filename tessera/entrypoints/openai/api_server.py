"""The OpenAI-compatible HTTP server (FastAPI) and the web chat page, over one shared engine.

tessera serve --model FOLDER --port 8000
"""

from __future__ import annotations

import functools
import hmac
import logging
import time
from pathlib import Path
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...engine.async_engine import AsyncEngine, EngineDeadError
from ...multimodal.media import load_image_url
from .body_limit import BodySizeLimit
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest, error_body
from .serving import OpenAIServing

logger = logging.getLogger(__name__)
WEB_DIR = Path(__file__).resolve().parents[1] / "web"
PROTECTED_PREFIXES = ("/v1/", "/tokenize")


def build_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    api_key: Optional[str] = None,
    allowed_media_dir: Optional[str] = None,
    max_images_per_prompt: Optional[int] = None,
    max_request_bytes: int = 32 * 2**20,
    image_fetch_timeout: float = 10.0,
    image_fetch_max_bytes: int = 20 * 2**20,
) -> FastAPI:
    """The app for a running AsyncEngine; `api_key` guards /v1/* and /tokenize."""
    app = FastAPI(title="Tessera", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(engine.engine)
    load_image = functools.partial(
        load_image_url, allowed_local_dir=allowed_media_dir, fetch_http=True,
        max_bytes=image_fetch_max_bytes, timeout=image_fetch_timeout,
    )  # fmt: skip
    serving = OpenAIServing(engine, metrics, model_name, load_image, max_images_per_prompt)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, serving
    model_path = str(engine.engine.model_config.model)

    def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
        if status == 400:
            metrics.count("error")
        return JSONResponse(error_body(message, kind, status), status_code=status)

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
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc'] if x != 'body') or 'body'}: {err['msg']}" for err in e.errors()
        )
        return error(400, f"Invalid request: {problems}")

    @app.exception_handler(ValueError)
    async def bad_input(_: Request, e: ValueError) -> JSONResponse:
        return error(400, str(e))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return error(503, str(e), "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error(
            e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error"
        )

    def check_model(name: Optional[str]) -> None:
        if name not in (None, model_name, model_path):
            raise StarletteHTTPException(404, f"The model {name!r} does not exist; this server serves {model_name!r}.")

    def respond(result: Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest) -> Response:
        check_model(request.model)
        return respond(await serving.chat(request))

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest) -> Response:
        check_model(request.model)
        return respond(await serving.completion(request))

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        check_model(request.model)
        return await serving.tokenize(request)

    created = int(time.time())

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "tessera", "root": model_path,
                "max_model_len": engine.engine.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(WEB_DIR / "index.html")

    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
    return app


# serve() options that configure the engine; the rest configure the app.
ENGINE_OPTIONS = ("kv_cache_memory", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                  "multimodal_pipeline", "pipelines_dir", "pipeline_params")  # fmt: skip


def serve(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: Optional[str] = None,
    log_level: str = "info",
    **app_options: Any,
) -> None:
    """Load the model, start the engine thread and serve until interrupted."""
    import uvicorn

    from ...engine.llm_engine import LLMEngine

    engine_options = {k: app_options.pop(k) for k in list(app_options) if k in ENGINE_OPTIONS}
    if app_options.get("max_images_per_prompt") is not None:
        engine_options["limit_mm_per_prompt"] = {"image": app_options["max_images_per_prompt"]}
    engine = AsyncEngine(LLMEngine.from_options(model, **engine_options))
    app = build_app(engine, model_name=served_model_name or Path(model).name, **app_options)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        engine.shutdown()


class ServerThread:
    """Serve an app from a background thread on 127.0.0.1 (a free port unless given), e.g. for
    tests, benchmarks or a notebook: `with ServerThread(app) as url: ...`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import socket
        import threading

        import uvicorn

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.url = f"http://{host}:{self.socket.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("The server thread stopped during start-up")
            self.thread.join(0.01)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()
