"""Images, videos and audio for the server, loaded without blocking its event loop or the engine.

Downloads wait on the network, so they get a pool of their own with a fixed number of slots: a
request that finds every slot taken is told to retry (503) instead of queueing behind slow
URLs, and since each download has a total deadline (MediaPolicy.timeout) a slot is never held
for long. Decoding is CPU work and runs on a small pool of its own. Requests without URLs never
touch the download pool, so slow URLs cannot stall them.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from ...errors import ServerBusyError
from ...multimodal.audio import decode_audio, decode_audio_native
from ...multimodal.media import (
    MediaPolicy,
    decode_image,
    decode_video,
    is_http_url,
    read_media_bytes,
    read_video_data,
)


class AsyncMediaLoader:
    def __init__(self, policy: MediaPolicy, *, max_concurrent_fetches: int = 16, decode_workers: int = 2) -> None:
        self.policy = policy
        self._fetch_pool = ThreadPoolExecutor(max_concurrent_fetches, thread_name_prefix="tessera-fetch")
        self._fetch_slots = threading.BoundedSemaphore(max_concurrent_fetches)
        self._decode_pool = ThreadPoolExecutor(decode_workers, thread_name_prefix="tessera-decode")

    async def load(self, url: str, kind: str = "image", video_options: Optional[dict[str, Any]] = None) -> Any:
        """The image (kind="video": the video's sampled frames, a VideoFrames, sampled as `video_options`
        say: num_frames, fps; kind="audio": (waveform, sampling rate)) at `url` (data URL, allowed local
        file, or http(s) under the policy)."""
        loop = asyncio.get_running_loop()
        if is_http_url(url):
            if not self._fetch_slots.acquire(blocking=False):
                raise ServerBusyError(f"Too many {kind} downloads are in progress; retry shortly or send a data URL.")
            data = await loop.run_in_executor(self._fetch_pool, self._fetch, url, kind)
        elif kind == "video":  # base64 decoding (a file, or vLLM's JPEG frames) or a local file read: short
            data = await loop.run_in_executor(self._decode_pool, read_video_data, url, self.policy)
        else:
            data = await loop.run_in_executor(self._decode_pool, read_media_bytes, url, self.policy, kind)
        if kind == "video":
            decode = functools.partial(decode_video, data, self.policy, **(video_options or {}))
            return await loop.run_in_executor(self._decode_pool, decode)
        if kind == "audio":  # (waveform, its rate): the model's processing resamples it
            return await loop.run_in_executor(self._decode_pool, decode_audio_native, data)
        return await loop.run_in_executor(self._decode_pool, decode_image, data, self.policy)

    async def decode_audio(self, data: bytes, rate: int) -> Any:
        """An uploaded recording as a mono float32 waveform at `rate`, decoded on the decode pool."""
        return await asyncio.get_running_loop().run_in_executor(self._decode_pool, decode_audio, data, rate)

    def _fetch(self, url: str, kind: str = "image") -> bytes:
        try:
            return read_media_bytes(url, self.policy, kind)
        finally:  # freed when the download ends, even if its requester went away meanwhile
            self._fetch_slots.release()

    async def load_all(
        self, urls: Sequence[str], kind: str = "image", video_options: Optional[dict[str, Any]] = None
    ) -> list[Any]:
        """All images (or videos), loaded concurrently; the first failure is raised once all have settled."""
        results = await asyncio.gather(*(self.load(url, kind, video_options) for url in urls), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)

    def shutdown(self) -> None:
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        self._decode_pool.shutdown(wait=False, cancel_futures=True)
