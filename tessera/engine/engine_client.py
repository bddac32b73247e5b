"""`EngineClient`: what a server front-end (entrypoints/openai) uses of the engine, typed. `AsyncEngine`
implements it over any `EngineCoreClient` (an in-thread core, a child process, data-parallel replicas)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Optional, Protocol

from ..config import ModelConfig
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .input_preprocessor import InputPreprocessor
from .prompt import PromptInputs
from .transcription import Transcriber


class EngineClient(Protocol):
    tokenizer: Any
    preprocessor: InputPreprocessor  # renders chats and inline-image prompts
    chat_template: Optional[str]
    transcriber: Transcriber  # recordings -> transcription prompts
    model_config: ModelConfig
    max_model_len: int
    dead: Optional[BaseException]
    on_dead: list[Callable[[BaseException], None]]  # called (on any thread) when the engine dies

    @property
    def is_alive(self) -> bool: ...

    async def process(self, prompt: Any, params: Optional[SamplingParams] = None) -> PromptInputs:
        """The prompt processed (token ids, items), without queueing it; bad input raises InputError."""

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Process and queue a prompt; its outputs as they come (the last one finished). Bad input raises
        InputError before anything is queued; a reader that leaves aborts the request."""

    def abort_all(self, message: str) -> None:
        """End every request in flight (`RequestFailedError(message, 503)` on their streams)."""

    def stats(self) -> dict[str, int]: ...

    def replica_stats(self) -> list[dict[str, int]]: ...

    def shutdown(self) -> None: ...
