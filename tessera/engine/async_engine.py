"""The engine for asyncio callers (the server): one thread steps the engine, coroutines add
requests and read their outputs as they come.

The engine itself is single-threaded. Everything that touches its state — adding, aborting,
stepping — runs on the engine thread; coroutines hand it work through `call()` and receive each
request's outputs on an asyncio queue. So requests from many HTTP connections are batched
together step by step (continuous batching), and a bad request fails alone, before it is queued.
Prompt processing (tokenizing, the HF processor: the slow part of a request with images) runs on
a small worker pool first, so a heavy prompt never stalls the steps of the others.

A model failure fails only the requests of that step (`RequestFailedError` on their streams).
If the engine thread itself dies, every stream gets `EngineDeadError`, `is_alive` turns False and
the `on_dead` callbacks run (the server uses one to exit, so a supervisor restarts it).

It is the server's `EngineClient` (engine_client.py) whatever runs the core: the engine thread steps an
`EngineCore` itself, or, with data parallelism, waits for the outputs of the replicas its `LLMEngine`'s
`DataParallelClient` routes to (prompts are still processed here, once).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, TypeVar

from ..errors import EngineDeadError, RequestFailedError
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .core.client import report_death
from .llm_engine import LLMEngine
from .prompt import PromptInputs

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RequestStream:
    """The outputs of one request, in order; the last one is finished (or an exception)."""

    def __init__(self, engine: "AsyncEngine", request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False

    def put(self, item: Any) -> bool:
        """Hand an item to the reader (called on the engine thread); False when the reader's event
        loop has closed, i.e. nobody will read it."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:  # the reader went away (e.g. the client disconnected): free the request
                self.abort()

    def abort(self) -> None:
        self.finished = True
        if self.engine.is_alive:
            self.engine.submit(self.engine._abort, self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, preprocess_workers: int = 2) -> None:
        self.engine = engine
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._stopped = False
        self.dead: Optional[BaseException] = None
        self.on_dead: list[Callable[[BaseException], None]] = []
        self._preprocess = ThreadPoolExecutor(preprocess_workers, thread_name_prefix="tessera-preprocess")
        self._worker_death: Optional[BaseException] = None
        engine.core.watch(self._worker_died)  # a rank or replica dying stops the engine, even while idle
        self._thread = threading.Thread(target=self._run, name="tessera-engine", daemon=True)
        self._thread.start()

    # ---- what the server reads -------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def preprocessor(self) -> Any:
        """Renders chats and inline-image prompts (the engine's InputPreprocessor)."""
        return self.engine.input_preprocessor

    @property
    def chat_template(self) -> Optional[str]:
        return self.engine.input_preprocessor.chat_template

    @property
    def transcriber(self) -> Any:
        """Turns recordings into transcription prompts (the engine's Transcriber)."""
        return self.engine.transcriber

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> dict[str, int]:
        """The engine's counters now (`EngineCore.stats`; summed over data-parallel replicas)."""
        return self.engine.stats()

    def replica_stats(self) -> list[dict[str, int]]:
        """Each replica's counters (one entry without data parallelism)."""
        return self.engine.core.replica_stats()

    # ---- called from coroutines ------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the engine thread between steps and return (or raise) its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if future.done():
                return
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

        def run() -> None:
            try:
                result = fn(*args)
            except BaseException as e:
                loop.call_soon_threadsafe(settle, False, e)
            else:
                loop.call_soon_threadsafe(settle, True, result)

        self.submit(run)
        return await future

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue fn(*args) for the engine thread without waiting for it."""
        if not self.is_alive:
            raise EngineDeadError(f"The engine has stopped: {self.dead!r}")
        self._calls.put((fn, args))
        self._wakeup.set()
        self.engine.core.wake()  # a core elsewhere: the engine thread may be waiting for its outputs

    async def process(self, prompt: Any, params: Optional[SamplingParams] = None) -> PromptInputs:
        """Validate and process a prompt on the worker pool (the engine keeps stepping meanwhile);
        bad input raises ValueError."""
        if not self.is_alive:
            raise EngineDeadError(f"The engine has stopped: {self.dead!r}")
        loop = asyncio.get_running_loop()
        params = params or SamplingParams()
        return await loop.run_in_executor(self._preprocess, self.engine.process_inputs, prompt, params)

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> RequestStream:
        """Process and queue a prompt; bad input raises ValueError here, before anything is queued."""
        inputs = await self.process(prompt, params)
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        try:
            await self.call(self._add, stream, inputs, params)
        except asyncio.CancelledError:  # the caller went away; the add may still run: undo it after
            stream.abort()
            raise
        return stream

    def abort_all(self, message: str) -> None:
        """End every request in flight (their streams raise `RequestFailedError(message, 503)`) and
        free what they hold; new requests are still taken. Thread-safe; returns at once."""
        if self.is_alive:
            self.submit(self._abort_all, message)

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        self._preprocess.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()  # tensor-parallel workers, if any

    # ---- the engine thread -----------------------------------------------------------------------

    def _add(self, stream: RequestStream, inputs: PromptInputs, params: SamplingParams) -> None:
        self.engine.add_request(stream.request_id, inputs, params)
        self._streams[stream.request_id] = stream

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)

    def _abort_all(self, message: str) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self.engine.abort_request(request_id)
            stream.put(RequestFailedError(message, 503))

    def _worker_died(self, error: BaseException) -> None:
        """(On a monitor thread.) Make the engine thread stop with `error` at once."""
        self._worker_death = error
        self._wakeup.set()
        self.engine.core.wake()

    def _run(self) -> None:
        try:
            while not self._stopped:
                if self._worker_death is not None:
                    raise self._worker_death
                self._drain_calls()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                for output in self.engine.step():
                    stream = self._streams.get(output.request_id)
                    if stream is None:
                        continue
                    if output.finished:
                        del self._streams[output.request_id]
                    item = output if output.error is None else RequestFailedError(output.error, output.error_status)
                    if not stream.put(item) and not output.finished:  # its reader is gone: stop it
                        self._abort(output.request_id)
        except BaseException as e:  # the engine's own state is broken: fail every request, report death
            logger.exception("The engine thread stopped")
            self.dead = e
            report_death(self.on_dead, e)  # first, so that whoever sees a stream fail sees them done
            for stream in self._streams.values():
                stream.put(EngineDeadError(f"The engine stopped ({e}); the server must be restarted."))
            self._streams.clear()

    def _drain_calls(self) -> None:
        while True:
            try:
                fn, args = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fn(*args)
            except Exception:  # e.g. an abort racing a finish; never let it stop the engine
                logger.exception("Engine call %s failed", getattr(fn, "__name__", fn))


async def all_finished(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """Each stream's final output; if one fails (or the caller is cancelled) the others are aborted."""

    async def last(stream: RequestStream) -> RequestOutput:
        final = None
        async for output in stream:
            final = output
        assert final is not None
        return final

    tasks = [asyncio.ensure_future(last(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task, stream in zip(tasks, streams):
            task.cancel()
            stream.abort()
        raise
