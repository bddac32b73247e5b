"""The in-process front-end: prompts in, `RequestOutput`s out, one engine-core step at a time.

prompt -> `InputPreprocessor` (token ids, items) -> `EngineCoreRequest`s (one per sequence) -> `EngineCore.step()`
-> `OutputProcessor` (text, stop strings) -> `RequestOutput`. The offline `LLM` drives it step by step; the
server's `AsyncEngine` runs one on a thread of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional, Union

from ..config import CacheConfig, ModelConfig, MultiModalConfig, ParallelConfig, SchedulerConfig
from ..errors import InputError
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .core_io import EngineCoreRequest
from .engine_core import EngineCore
from .input_preprocessor import InputPreprocessor
from .output_processor import OutputProcessor
from .prompt import PromptInputs, PromptType

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: Optional[CacheConfig] = None,
        scheduler_config: Optional[SchedulerConfig] = None,
        parallel_config: Optional[ParallelConfig] = None,
    ) -> None:
        self.core = core = EngineCore(model_config, cache_config, scheduler_config, parallel_config)
        self.model_config = model_config
        self.tokenizer, self.processor = core.tokenizer, core.processor
        self.max_model_len = core.info.max_model_len
        get_placeholder = getattr(type(core.model), "get_placeholder_str", None)
        self.input_preprocessor = InputPreprocessor(
            model_config, self.tokenizer, self.processor, core.info.limits, chat_renderer=core.built.chat_renderer(),
            placeholder=(lambda i: get_placeholder("image", i)) if get_placeholder else None,
            video_placeholder=self._video_placeholder(get_placeholder),
        )  # fmt: skip
        self.output_processor = OutputProcessor(self.tokenizer)

    def _video_placeholder(self, get_placeholder: Any) -> Optional[Any]:
        """The model's prompt text for video i, if it takes videos: it has a placeholder for them
        and its processor supports the modality."""
        if get_placeholder is None or get_placeholder("video", 0) is None:
            return None
        info = getattr(self.processor, "info", None)
        if info is None or "video" not in info.get_supported_mm_limits():
            return None
        return lambda i: get_placeholder("video", i)

    @classmethod
    def from_options(cls, model: str, **options: Any) -> "LLMEngine":
        """An engine for a model folder; options are fields of ModelConfig, CacheConfig, SchedulerConfig,
        ParallelConfig and MultiModalConfig (limit_mm_per_prompt is MultiModalConfig.limit_per_prompt)."""
        configs = (ModelConfig, CacheConfig, SchedulerConfig, MultiModalConfig, ParallelConfig)
        groups: dict[type, dict[str, Any]] = {c: {} for c in configs}
        renames = {"limit_mm_per_prompt": "limit_per_prompt"}
        settable = {c: {f.name for f in dataclasses.fields(c) if f.init} for c in configs}  # not hf_config, gguf_file
        for name, value in options.items():
            name = renames.get(name, name)
            owner = next((c for c in groups if name in settable[c]), None)
            if owner is None:
                raise ValueError(f"Unknown LLM option {name!r}")
            groups[owner][name] = value
        mm_config = MultiModalConfig(**groups[MultiModalConfig])
        model_config = ModelConfig(model, multimodal_config=mm_config, **groups[ModelConfig])
        return cls(
            model_config,
            CacheConfig(**groups[CacheConfig]),
            SchedulerConfig(**groups[SchedulerConfig]),
            ParallelConfig(**groups[ParallelConfig]),
        )

    # ---- requests -------------------------------------------------------------------------------

    def process_inputs(self, prompt: Union[PromptType, PromptInputs], params: SamplingParams) -> PromptInputs:
        """The InputPreprocessor's work, and compiling the request's output constraint into the grammar
        cache (thread-safe; touches no other engine state: any thread may run it)."""
        inputs = self.input_preprocessor.process(prompt, params)
        if params.structured_outputs is not None:
            self.core.structured_output.compile(params.structured_outputs)  # an invalid one raises InputError
        return inputs

    def add_request(
        self,
        request_id: str,
        prompt: Union[PromptType, PromptInputs],
        params: SamplingParams,
        arrival_time: Optional[float] = None,
    ) -> None:
        """Queue a prompt (processed here unless it is already `PromptInputs`). Bad input raises
        ValueError and leaves the engine as it was."""
        if request_id in self.output_processor:
            raise InputError(f"Request id {request_id!r} is already in use")
        inputs = self.process_inputs(prompt, params)
        requests = core_requests(request_id, inputs, params, self.max_model_len, arrival_time or time.monotonic())
        self.output_processor.add(
            request_id, inputs, [(r.request_id, r.sampling_params, r.arrival_time) for r in requests]
        )
        for request in requests:
            self.core.add_request(request)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free what it holds; it produces no further output."""
        self.core.abort(self.output_processor.sequence_ids(request_id))
        self.output_processor.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- stepping -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One core step, and the outputs of the requests it advanced (finished ones for the last time).
        Sequences a stop string ended, and the other sequences of a request the core failed, are ended in
        the core before the next step. A failure of the core's own state propagates (`EngineCore.step`)."""
        processed = self.output_processor.process(self.core.step())
        self.core.abort(processed.stopped, stopped=True)
        self.core.abort(processed.aborted)
        return processed.outputs

    def stats(self) -> dict[str, int]:
        return self.core.stats()

    def check_health(self) -> None:
        """Raise `WorkerDiedError` if a tensor-parallel worker has died."""
        self.core.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step afterwards)."""
        self.core.shutdown()


def core_requests(
    request_id: str, inputs: PromptInputs, params: SamplingParams, max_model_len: int, arrival_time: float
) -> list[EngineCoreRequest]:
    """A processed prompt as the core's requests: one per sequence of `params.n` (ids "id#i" when n > 1; seeds
    seed + i), each with max_tokens within the context."""
    max_tokens = min(params.max_tokens or max_model_len, max_model_len - len(inputs.token_ids))
    requests = []
    for index in range(params.n):
        seed = None if params.seed is None else params.seed + index
        sequence_params = dataclasses.replace(params, n=1, seed=seed, max_tokens=max_tokens)
        sequence_id = request_id if params.n == 1 else f"{request_id}#{index}"
        requests.append(
            EngineCoreRequest(sequence_id, inputs.token_ids, sequence_params, inputs.mm_items, arrival_time)
        )
    return requests
