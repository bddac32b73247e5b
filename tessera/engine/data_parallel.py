"""Data parallelism: N engine replicas, each in its own process (`ReplicaClient`), behind one server.

Routing (`Router`): a request whose prompt carries images or videos goes by its first item's key (`routing_key`:
the item's id from "multi_modal_uuids" when one is given, else `MultiModalHasher.hash_kwargs` of the raw item)
to the replica that got that key before, whose prefix cache and encoder cache (and processor cache) hold the
item; a request without media, or with a key not seen yet, goes to the least-loaded replica (fewest requests in
flight, ties to the lowest index), and a new key is remembered (a bounded LRU of `max_routing_keys` keys).

A dead replica is not routed around: `is_alive` turns False as soon as one dies, its requests fail with an
`EngineDeadError` naming it, and the `on_dead` callbacks run (the server exits, as it does when its one engine
dies). `DataParallelEngine` presents what the server reads of `AsyncEngine` (`tokenizer`, `preprocessor`,
`chat_template`, `model_config`, `max_model_len`, `stats()`), the tokenizer loaded in this process and the rest
from replica 0's start-up info; chat templates are rendered by a replica (the text only: media stay here).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

from ..errors import InputError
from ..tokenizer_utils import load_tokenizer
from ..multimodal.hasher import MultiModalHasher
from ..multimodal.inline_images import inline_images_to_prompt
from ..sampling_params import SamplingParams
from .async_engine import EngineDeadError, RequestStream
from .chat_utils import ImageLoader, Message, VideoLoader, parse_chat_media, render_plain, with_media
from .prompt import PromptInputs
from .replica import ReplicaClient
from .replica_process import PLACEHOLDER_TABLE

logger = logging.getLogger(__name__)

MODALITY_ORDER = ("image", "video")  # which modality's first item keys a prompt that has both


def routing_key(prompt: Any) -> Optional[str]:
    """The key a prompt is routed by: its first item's id or content hash (images before videos), or None
    for a prompt without media (or media the hasher cannot read)."""
    if isinstance(prompt, PromptInputs):
        return f"hash:{prompt.mm_items[0].hash}" if prompt.mm_items else None
    if not isinstance(prompt, Mapping):
        return None
    data = prompt.get("multi_modal_data")
    if not isinstance(data, Mapping):
        return None
    uuids = prompt.get("multi_modal_uuids")
    modalities = [m for m in MODALITY_ORDER if m in data] + sorted(m for m in data if m not in MODALITY_ORDER)
    for modality in modalities:
        items = data[modality]
        if isinstance(items, (list, tuple)):
            if not items:
                continue
            first = items[0]
        elif items is None:
            continue
        else:
            first = items
        ids = uuids.get(modality) if isinstance(uuids, Mapping) else None
        ids = [ids] if isinstance(ids, str) else ids
        if isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], str):
            return f"uuid:{modality}:{ids[0]}"
        try:
            return f"{modality}:{MultiModalHasher.hash_kwargs(**{modality: first})}"
        except (TypeError, ValueError):
            return None
    return None


class Router:
    """Which replica serves a request: the one that got its key before, else the least loaded."""

    def __init__(self, size: int, max_keys: int = 4096) -> None:
        if size < 1:
            raise ValueError(f"A router needs at least one replica, got {size}")
        self.size, self.max_keys = size, max_keys
        self.keys: OrderedDict[str, int] = OrderedDict()

    def route(self, key: Optional[str], loads: Sequence[int], *, remember: bool = True) -> int:
        """The replica for a request with routing key `key` (None: no media), given each replica's
        requests in flight; a new key is remembered for the replica chosen unless `remember` is False."""
        if key is not None:
            index = self.keys.get(key)
            if index is not None:
                self.keys.move_to_end(key)
                return index
        index = min(range(self.size), key=lambda i: (loads[i], i))
        if key is not None and remember:
            self.keys[key] = index
            while len(self.keys) > self.max_keys:
                self.keys.popitem(last=False)
        return index


class DataParallelEngine:
    """N replicas of one engine (the same model and options), each in a process of its own."""

    def __init__(
        self,
        model: str,
        engine_options: Optional[Mapping[str, Any]] = None,
        size: int = 2,
        *,
        start_timeout: Optional[float] = 600.0,
        max_routing_keys: int = 4096,
    ) -> None:
        if size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {size}")
        threads = max(1, (os.cpu_count() or 1) // size)
        options = dict(engine_options or {})
        self.replicas: list[ReplicaClient] = []
        try:
            for index in range(size):  # all start at once, then each is waited for
                self.replicas.append(ReplicaClient(index, model, options, num_threads=threads))
            for replica in self.replicas:
                replica.wait_ready(start_timeout)
        except BaseException:
            for replica in self.replicas:
                replica.shutdown(timeout=2.0)
            raise
        info = self.replicas[0].info
        self._model_config = info["model_config"]
        self._max_model_len = info["max_model_len"]
        self._tokenizer = load_tokenizer(self._model_config)
        self._preprocessor = RemotePreprocessor(self, info)
        self.router = Router(size, max_routing_keys)
        self.dead: Optional[BaseException] = None
        self.on_dead: list[Callable[[BaseException], None]] = []
        self._dead_lock = threading.Lock()
        self._turn = itertools.count()
        for replica in self.replicas:
            replica.on_dead.append(self._replica_died)

    # ---- what the server reads -----------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.replicas)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def preprocessor(self) -> "RemotePreprocessor":
        return self._preprocessor

    @property
    def chat_template(self) -> Optional[str]:
        return self._preprocessor.chat_template

    @property
    def model_config(self) -> Any:
        return self._model_config

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def is_alive(self) -> bool:
        return self.dead is None and all(replica.is_alive for replica in self.replicas)

    def replica_stats(self) -> list[dict[str, int]]:
        """Each replica's latest stats snapshot (pushed by the replica), with its requests in flight."""
        return [{**replica.last_stats, "in_flight": replica.num_in_flight} for replica in self.replicas]

    def stats(self) -> dict[str, int]:
        """The replicas' latest stats, summed."""
        total: dict[str, int] = {}
        for snapshot in self.replica_stats():
            for name, value in snapshot.items():
                total[name] = total.get(name, 0) + value
        return total

    async def refresh_stats(self) -> list[dict[str, int]]:
        """Fresh snapshots from every replica (the pushed ones may be up to a moment old)."""
        await asyncio.gather(*(replica.stats() for replica in self.replicas))
        return self.replica_stats()

    # ---- requests ------------------------------------------------------------------------------------

    def loads(self) -> list[int]:
        return [replica.num_in_flight for replica in self.replicas]

    async def _key(self, prompt: Any) -> Optional[str]:
        has_media = isinstance(prompt, Mapping) and prompt.get("multi_modal_data")
        if not has_media:
            return routing_key(prompt)
        return await asyncio.to_thread(routing_key, prompt)  # hashing pixels: off the event loop

    def _check_alive(self) -> None:
        if not self.is_alive:
            dead = self.dead or next((r.dead for r in self.replicas if r.dead is not None), None)
            raise EngineDeadError(str(dead) if dead is not None else "An engine replica has stopped.")

    async def process(self, prompt: Any, params: Optional[SamplingParams] = None) -> PromptInputs:
        """Process a prompt on the replica its items would go to (without remembering a new key)."""
        self._check_alive()
        key = await self._key(prompt)
        index = self.router.route(key, self.loads(), remember=False)
        return await self.replicas[index].process(prompt, params)

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> RequestStream:
        """Route and queue a prompt; bad input raises ValueError here, before anything is queued."""
        self._check_alive()
        key = await self._key(prompt)
        index = self.router.route(key, self.loads())  # no await between choosing and counting the request
        return await self.replicas[index].add_request(request_id, prompt, params)

    def abort_all(self, message: str) -> None:
        """End every request in flight on every replica (`RequestFailedError(message, 503)` on their streams)."""
        for replica in self.replicas:
            replica.abort_all(message)

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica._closing = True  # stopping on purpose is no death
        for replica in self.replicas:
            replica.shutdown()

    def _replica_died(self, error: BaseException) -> None:
        with self._dead_lock:
            if self.dead is not None:
                return
            self.dead = error
        for callback in self.on_dead:
            try:
                callback(error)
            except Exception:
                logger.exception("An on_dead callback failed")

    def _renderer(self) -> ReplicaClient:
        """The replica that renders the next chat template (in turn: rendering is cheap but not free)."""
        return self.replicas[next(self._turn) % len(self.replicas)]


def _stand_ins(messages: Sequence[Message]) -> list[Any]:
    """The messages with each media part's URL or image replaced by a short stand-in: the template needs
    only where the parts are, and the media stay in this process."""
    out: list[Any] = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in ("image_url", "image_pil"):
                part = {"type": "image_url", "image_url": {"url": "-"}, "uuid": part.get("uuid")}
            elif kind == "video_url":
                part = {"type": "video_url", "video_url": {"url": "-"}, "uuid": part.get("uuid")}
            parts.append(part)
        out.append({**message, "content": parts})
    return out


class RemotePreprocessor:
    """What the server uses of the InputPreprocessor, for replicas in other processes: chats are checked
    and their media loaded here, and their text rendered by a replica (so exactly as an engine renders it)."""

    def __init__(self, engine: DataParallelEngine, info: Mapping[str, Any]) -> None:
        self.engine = engine
        self.chat_template: Optional[str] = info["chat_template"]
        self.image_text: Optional[str] = info["image_text"]
        self.max_prompt_chars: int = info["max_prompt_chars"]
        self.model_type: str = info["model_type"]
        self._takes_video: bool = info["takes_video"]
        self._tables = {"image": info["image_placeholders"], "video": info["video_placeholders"]}
        self.placeholder = self._placeholder_of("image")
        self.video_placeholder = self._placeholder_of("video")

    def _placeholder_of(self, modality: str) -> Optional[Callable[[int], Optional[str]]]:
        table = self._tables[modality]
        if table is None:
            return None

        def placeholder(i: int) -> Optional[str]:
            if i < PLACEHOLDER_TABLE:
                return table[i]
            return self.engine.replicas[0].call_sync("placeholder", modality, i)

        return placeholder

    @property
    def takes_video(self) -> bool:
        return self._takes_video

    def video_loader(self, load_video: Optional[VideoLoader]) -> VideoLoader:
        def load(url: str) -> Any:
            if not self.takes_video:
                raise InputError(
                    f"This model ({self.model_type}) does not support video input; send images or text instead."
                )
            if load_video is None:
                raise InputError("Video input (a video_url part) is not supported here.")
            return load_video(url)

        return load

    def render_chat(
        self,
        messages: Sequence[Message],
        load_image: ImageLoader,
        *,
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        content_format: str = "auto",
        plain_fallback: bool = False,
        load_video: Optional[VideoLoader] = None,
        tools: Optional[list[dict]] = None,
    ) -> dict:
        """As InputPreprocessor.render_chat; blocks on a replica (call it off the event loop)."""
        video = self.video_loader(load_video)
        if chat_template is None and self.chat_template is None and plain_fallback:
            return render_plain(messages, load_image, self.placeholder, load_video=video,
                                video_placeholder=self.video_placeholder)  # fmt: skip
        _, media, uuids = parse_chat_media(messages, load_image, self.image_text, load_video=video)
        options = {"add_generation_prompt": add_generation_prompt, "chat_template": chat_template,
                   "content_format": content_format, "tools": tools}  # fmt: skip
        text = self.engine._renderer().call_sync("render_chat", _stand_ins(messages), options)
        return with_media(text, media, uuids)

    def render_inline(self, text: str, load_image: ImageLoader) -> dict:
        return inline_images_to_prompt(text, self.placeholder, load_image)
