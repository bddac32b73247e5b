"""The replica process's side of `engine/replica.py`: build the engine, say "ready" with the start-up info,
then serve the parent's commands from the pipe (an asyncio loop fed by a reader thread) until told to stop or
until the parent goes away. Outputs, replies and stats snapshots go back as pickled tuples."""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ..sampling_params import SamplingParams
from .async_engine import AsyncEngine, EngineDeadError, RequestFailedError

STATS_INTERVAL = 0.25  # seconds: the most often a replica pushes its stats while busy
PLACEHOLDER_TABLE = 64  # placeholders of items 0..63 come with the start-up info; later ones are asked for


def dumps(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else an exception of its kind (ValueError or RuntimeError) with its text."""
    try:
        pickle.loads(dumps(error))
        return error
    except Exception:
        return (ValueError if isinstance(error, ValueError) else RuntimeError)(str(error))


def replica_main(conn: Connection, index: int, model: str, engine_options: dict[str, Any], num_threads: int) -> None:
    """The replica process: build the engine, say "ready" with the start-up info, serve until told to
    stop or until the parent goes away (end of file on the pipe)."""
    import torch

    torch.set_num_threads(num_threads)  # N replicas share the cores instead of oversubscribing them
    lock = threading.Lock()

    def send(message: tuple) -> None:
        data = dumps(message)
        with lock:
            conn.send_bytes(data)

    try:
        from .llm_engine import LLMEngine

        engine = AsyncEngine(LLMEngine.from_options(model, **engine_options))
    except BaseException as e:
        try:
            bad_input = isinstance(e, (ValueError, OSError))
            send(("failed", str(e) if bad_input else f"{type(e).__name__}: {e}", traceback.format_exc(), bad_input))
        finally:
            os._exit(1)
    try:
        send(("ready", _startup_info(engine)))
        asyncio.run(_ReplicaServer(conn, engine, send).run())
    except (EOFError, OSError):  # the parent went away
        pass
    finally:
        engine.shutdown()
    os._exit(0)  # not waiting on worker threads of a finished engine


def _startup_info(engine: AsyncEngine) -> dict[str, Any]:
    """What the parent needs without asking: configuration, and how prompts are rendered."""
    pre = engine.preprocessor
    table = range(PLACEHOLDER_TABLE)
    return {
        "pid": os.getpid(),
        "model_config": engine.model_config,
        "max_model_len": engine.max_model_len,
        "chat_template": pre.chat_template,
        "image_text": pre.image_text,
        "takes_video": pre.takes_video,
        "model_type": engine.model_config.hf_config.model_type,
        "max_prompt_chars": pre.max_prompt_chars,
        "image_placeholders": [pre.placeholder(i) for i in table] if pre.placeholder else None,
        "video_placeholders": [pre.video_placeholder(i) for i in table] if pre.video_placeholder else None,
        "stats": engine.stats(),
    }


class _ReplicaServer:
    def __init__(self, conn: Connection, engine: AsyncEngine, send: Callable[[tuple], None]) -> None:
        self.conn, self.engine, self.send = conn, engine, send
        self.requests: dict[str, asyncio.Task] = {}
        self.tasks: set[asyncio.Task] = set()
        self.last_stats: dict[str, int] = {}

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.done = asyncio.Event()

        def stop(*_: Any) -> None:
            loop.call_soon_threadsafe(self.done.set)

        def on_dead(error: BaseException) -> None:
            try:
                self.send(("engine_dead", repr(error)))
            finally:
                stop()

        self.engine.on_dead.append(on_dead)
        threading.Thread(target=self._read, args=(loop, stop), name="tessera-replica-reader", daemon=True).start()
        stats = asyncio.ensure_future(self._push_stats())
        await self.done.wait()
        stats.cancel()
        for task in list(self.requests.values()) + list(self.tasks):
            task.cancel()

    def _read(self, loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> None:
        while True:
            try:
                message = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):  # the parent went away: stop
                stop()
                return
            try:
                loop.call_soon_threadsafe(self._handle, message)
            except RuntimeError:  # the loop has closed
                return

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, call_id, request_id, prompt, params = message
            self.requests[request_id] = asyncio.ensure_future(self._serve(call_id, request_id, prompt, params))
        elif kind == "abort":
            task = self.requests.pop(message[1], None)
            if task is not None:
                task.cancel()  # its stream aborts the request on the engine
        elif kind == "process":
            _, call_id, prompt, params = message
            self._spawn(self._reply(call_id, self.engine.process(prompt, params)))
        elif kind == "render_chat":
            _, call_id, messages, options = message
            self._spawn(self._reply(call_id, asyncio.to_thread(self._render_chat, messages, options)))
        elif kind == "placeholder":
            _, call_id, modality, i = message
            pre = self.engine.preprocessor
            make = pre.placeholder if modality == "image" else pre.video_placeholder
            self._reply_now(call_id, True, make(i) if make is not None else None)
        elif kind == "stats":
            self._reply_now(message[1], True, self._stats_now())
        elif kind == "shutdown":
            self.done.set()

    def _render_chat(self, messages: Any, options: dict[str, Any]) -> str:
        """The text of a chat (its media stand-ins are never loaded: the parent has the media)."""
        prompt = self.engine.preprocessor.render_chat(messages, lambda url: url, load_video=lambda url: url, **options)
        return prompt["prompt"]

    def _reply_now(self, call_id: int, ok: bool, value: Any) -> None:
        self.send(("result", call_id, ok, value if ok else portable(value)))

    async def _reply(self, call_id: int, work: Any) -> None:
        try:
            value = await work
        except Exception as e:
            self._reply_now(call_id, False, e)
        else:
            self._reply_now(call_id, True, value)

    async def _serve(self, call_id: int, request_id: str, prompt: Any, params: SamplingParams) -> None:
        try:
            try:
                stream = await self.engine.add_request(request_id, prompt, params)
            except asyncio.CancelledError:
                self._reply_now(call_id, False, RuntimeError("aborted"))
                raise
            except Exception as e:
                self._reply_now(call_id, False, e)
                return
            self._reply_now(call_id, True, None)
            try:
                async for output in stream:
                    self.send(("out", request_id, output))
            except RequestFailedError as e:
                self.send(("error", request_id, "failed", str(e)))
            except EngineDeadError as e:
                self.send(("error", request_id, "dead", str(e)))
        finally:
            if self.requests.get(request_id) is asyncio.current_task():
                del self.requests[request_id]
            if not self.requests:  # idle: the parent's gauges read zero now, not a moment later
                self._maybe_push_stats()

    def _stats_now(self) -> dict[str, int]:
        self.last_stats = self.engine.stats()
        return self.last_stats

    def _maybe_push_stats(self) -> None:
        previous = self.last_stats
        if self._stats_now() != previous:
            self.send(("stats", self.last_stats))

    async def _push_stats(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL)
            self._maybe_push_stats()
