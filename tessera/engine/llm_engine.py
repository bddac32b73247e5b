"""The front-end: prompts in, `RequestOutput`s out, one engine-core step at a time.

prompt -> `InputPreprocessor` (token ids, items) -> `EngineCoreRequest`s (one per sequence) -> the core's
`step()` -> `OutputProcessor` (text, stop strings) -> `RequestOutput`. The core is an `EngineCoreClient`: an
`EngineCore` in this thread by default, or cores in other processes (`LLMEngine.data_parallel`). The offline
`LLM` drives it step by step; the server's `AsyncEngine` runs one on a thread of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional, Union

from ..config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, engine_configs
from ..errors import InputError
from ..gguf_reading import release_gguf_readers
from ..models.factory import BuiltProcessor, build_processor
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..tokenizer_utils import load_tokenizer
from .core.client import EngineCoreClient
from .core.core_io import EngineCoreRequest, EngineLimits
from .core.structured_output import StructuredOutputManager
from .executor.local_core import start_core
from .input_preprocessor import InputPreprocessor
from .output_processor import OutputProcessor
from .prompt import PromptInputs, PromptType
from .transcription import Transcriber

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: Optional[CacheConfig] = None,
        scheduler_config: Optional[SchedulerConfig] = None,
        parallel_config: Optional[ParallelConfig] = None,
        *,
        core: Optional[EngineCoreClient] = None,
    ) -> None:
        """A front-end over `core` (an `EngineCoreClient` for cores elsewhere: a child process, data-parallel
        replicas; it is shut down with this engine), or over an `EngineCore` built here from the configs."""
        self.model_config = model_config
        if core is None:
            local = start_core(model_config, cache_config, scheduler_config, parallel_config)
            inputs, grammars = local.built.inputs, local.structured_output  # one grammar cache for both sides
            core = local
        else:
            try:
                inputs = build_processor(model_config, load_tokenizer(model_config))
                if inputs.processor is not None:
                    inputs.processor.check_mm_kwargs()
            except BaseException:
                core.shutdown()
                raise
            vocab_size = model_config.hf_config.get_text_config().vocab_size
            grammars = StructuredOutputManager(inputs.tokenizer, vocab_size, core.info.eos_token_ids)
        self.core: EngineCoreClient = core
        self.tokenizer, self.processor = inputs.tokenizer, inputs.processor
        self.max_model_len = core.info.max_model_len
        self.structured_output = grammars  # checks output constraints at admission (compiled once, cached)
        self.input_preprocessor = _input_preprocessor(model_config, inputs, core.info.limits)
        self.transcriber = Transcriber(self.input_preprocessor, inputs.model_cls)
        self.output_processor = OutputProcessor(self.tokenizer)
        release_gguf_readers()  # a GGUF file's parse, kept for its config, tokenizer and weights (also when a core
        # in another process loaded the weights)

    @classmethod
    def from_options(cls, model: str, **options: Any) -> "LLMEngine":
        """An engine for a model folder; options are fields of ModelConfig, CacheConfig, SchedulerConfig,
        ParallelConfig and MultiModalConfig (`config.engine_configs`)."""
        return cls(*engine_configs(model, **options))

    @classmethod
    def data_parallel(cls, model: str, engine_options: Optional[dict[str, Any]] = None, size: int = 2) -> "LLMEngine":
        """A front-end here over `size` engine cores, each in a process of its own with the same options
        (`DataParallelClient`); prompts are processed here and each replica gets processed requests."""
        from .executor.data_parallel import DataParallelClient

        configs = engine_configs(model, **(engine_options or {}))  # bad options fail before any process starts
        return cls(*configs, core=DataParallelClient(model, engine_options, size))

    # ---- requests -------------------------------------------------------------------------------

    def process_inputs(self, prompt: Union[PromptType, PromptInputs], params: SamplingParams) -> PromptInputs:
        """The InputPreprocessor's work, and compiling the request's output constraint into the grammar
        cache (thread-safe; touches no other engine state: any thread may run it)."""
        inputs = self.input_preprocessor.process(prompt, params)
        if params.structured_outputs is not None:
            self.structured_output.compile(params.structured_outputs)  # an invalid one raises InputError
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
        self._check_runner(params)
        inputs = self.process_inputs(prompt, params)
        requests = core_requests(request_id, inputs, params, self.max_model_len, arrival_time or time.monotonic())
        self.output_processor.add(
            request_id, inputs, [(r.request_id, r.sampling_params, r.arrival_time) for r in requests]
        )
        try:
            for request in requests:
                self.core.add_request(request)
        except BaseException:  # e.g. a replica that died: nothing of the request stays behind
            self.abort_request(request_id)
            raise

    def _check_runner(self, params: SamplingParams) -> None:
        """Generation needs the generate runner, pooling the pooling runner (and dimensions the model has)."""
        pooling = params.pooling
        if self.model_config.runner == "pooling" and pooling is None:
            raise InputError("This model runs as an embedding model (runner='pooling'): it does not generate; "
                             "use LLM.embed or /v1/embeddings, or load it with runner='generate'.")  # fmt: skip
        if self.model_config.runner != "pooling" and pooling is not None:
            raise InputError("Embeddings need the model loaded as one: LLM(model, runner='pooling') or "
                             "`tessera serve MODEL --runner pooling`.")  # fmt: skip
        config = self.model_config.hf_config  # a retrieval model's own width (ColQwen2's embedding_dim), else hidden
        width = getattr(config, "embedding_dim", None) or config.get_text_config().hidden_size
        if pooling is not None and pooling.dimensions is not None and pooling.dimensions > width:
            raise InputError(f"dimensions {pooling.dimensions} exceeds the model's embedding size {width}.")

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
        """The core's counters (`EngineCore.stats`, summed over replicas), the processor cache's from here:
        prompts are processed by this front-end."""
        stats = dict(self.core.stats())
        cache = getattr(self.processor, "cache", None)
        stats["processor_cache_queries"] = cache.stats.queries if cache is not None else 0
        stats["processor_cache_hits"] = cache.stats.hits if cache is not None else 0
        return stats

    def check_health(self) -> None:
        """Raise `WorkerDiedError` if a tensor-parallel worker has died."""
        self.core.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step afterwards)."""
        self.core.shutdown()


def _input_preprocessor(model_config: ModelConfig, inputs: BuiltProcessor, limits: EngineLimits) -> InputPreprocessor:
    """The preprocessor of a model: its processor, chat renderer and the prompt texts of its items."""
    get_placeholder = getattr(inputs.model_cls, "get_placeholder_str", None)
    image = (lambda i: get_placeholder("image", i)) if get_placeholder else None
    video = None
    info = getattr(inputs.processor, "info", None)
    takes_video = info is not None and "video" in info.get_supported_mm_limits()
    if get_placeholder is not None and get_placeholder("video", 0) is not None and takes_video:
        video = lambda i: get_placeholder("video", i)  # noqa: E731
    audio = None
    if get_placeholder is not None and info is not None and "audio" in info.get_supported_mm_limits():
        audio = lambda i: get_placeholder("audio", i)  # noqa: E731
    return InputPreprocessor(
        model_config, inputs.tokenizer, inputs.processor, limits,
        chat_renderer=inputs.chat_renderer(), placeholder=image, video_placeholder=video, audio_placeholder=audio,
    )  # fmt: skip


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
            EngineCoreRequest(sequence_id, inputs.token_ids, sequence_params, inputs.mm_items, arrival_time,
                              inputs.prompt_embeds)  # fmt: skip
        )
    return requests
