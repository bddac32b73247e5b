"""The engine: requests in, one scheduled step at a time, outputs out."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any, Optional, Union

from ..config import CacheConfig, ModelConfig, MultiModalConfig, ParallelConfig, SchedulerConfig
from ..distributed import get_tp_group, tensor_parallel_group
from ..errors import InputError, WorkerDiedError
from ..layers.kv_cache import kv_cache_bytes_per_block, kv_window
from ..models.factory import build_model
from ..tokenizer_utils import load_tokenizer
from ..multimodal.profiling import MultiModalProfiler
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .block_manager import BlockManager
from .encoder_cache import EncoderCache
from .input_preprocessor import EngineLimits, InputPreprocessor
from .model_runner import EncoderInputError, ModelRunner
from .output_processor import OutputProcessor
from .prompt import PromptInputs, PromptType
from .request import Request, RequestStatus
from .scheduler import Scheduler, SchedulerOutput
from .structured_output import StructuredOutputManager
from .workers import WorkerGroup, start_workers

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: Optional[CacheConfig] = None,
        scheduler_config: Optional[SchedulerConfig] = None,
        parallel_config: Optional[ParallelConfig] = None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config = cache_config or CacheConfig()
        self.scheduler_config = scheduler_config = scheduler_config or SchedulerConfig()
        self.parallel_config = parallel_config = parallel_config or ParallelConfig()
        self.tokenizer = load_tokenizer(model_config)
        self.workers: Optional[WorkerGroup] = None
        if parallel_config.tensor_parallel_size > 1:
            if model_config.multimodal_config.uses_pipeline:
                raise ValueError("Vision pipelines do not support tensor parallelism; use tensor_parallel_size=1.")
            self.workers = start_workers(model_config, parallel_config)
        try:
            self._init(model_config, cache_config, scheduler_config)
        except BaseException:
            self.shutdown()
            raise

    def _init(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> None:
        group = self.workers.group if self.workers is not None else get_tp_group()
        with tensor_parallel_group(group):  # the language model's layers take this rank's slice
            self.built = build_model(model_config, self.tokenizer)
        self.model, self.processor, self.pipeline = self.built.model, self.built.processor, self.built.pipeline

        text_config = model_config.hf_config.get_text_config()
        self.max_model_len = scheduler_config.max_model_len or text_config.max_position_embeddings
        self.eos_token_ids = _eos_token_ids(self.tokenizer, text_config, model_config.hf_config)

        max_item = 0
        if self.processor is not None:
            self.processor.check_mm_kwargs()  # the model's mm_processor_kwargs, refused here if misspelt
            max_item = max(MultiModalProfiler(self.processor).get_mm_max_tokens_per_item(self.max_model_len).values())
        self.encoder_budget = max(
            scheduler_config.max_num_encoder_input_tokens or scheduler_config.max_num_batched_tokens, max_item
        )
        encoder_cache = EncoderCache(cache_config.encoder_cache_size or self.encoder_budget)

        block_bytes = kv_cache_bytes_per_block(self.model, cache_config.block_size, model_config.dtype)
        num_blocks = cache_config.kv_cache_memory // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {cache_config.kv_cache_memory} B holds no block of {block_bytes} B")
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB)",
            num_blocks, cache_config.block_size, num_blocks * cache_config.block_size, num_blocks * block_bytes / 2**20,
        )  # fmt: skip
        self.num_blocks = num_blocks
        self.block_manager = BlockManager(
            num_blocks, cache_config.block_size, enable_prefix_caching=cache_config.enable_prefix_caching
        )
        self.encoder_cache = encoder_cache
        if getattr(self.model, "is_mm_prefix_lm", False):  # a chunk ending inside an image lacks its later tokens
            scheduler_config = dataclasses.replace(scheduler_config, disable_chunked_mm_input=True)  # not the caller's
            self.scheduler_config = scheduler_config
        self.kv_window = kv_window(self.model) if cache_config.free_out_of_window_blocks else None
        self.scheduler = Scheduler(
            scheduler_config, self.block_manager, encoder_cache, self.encoder_budget, self.max_model_len,
            kv_window=self.kv_window,
        )  # fmt: skip
        self.runner = ModelRunner(
            self.model,
            num_blocks=num_blocks,
            block_size=cache_config.block_size,
            dtype=model_config.dtype,
            device=model_config.device,
            workers=self.workers,
        )
        limits = EngineLimits(
            max_model_len=self.max_model_len,
            encoder_rows=min(self.encoder_budget, encoder_cache.capacity),
            kv_tokens=num_blocks * cache_config.block_size,
            whole_item_tokens=(
                scheduler_config.max_num_batched_tokens if scheduler_config.disable_chunked_mm_input else None
            ),
        )
        get_placeholder = getattr(type(self.model), "get_placeholder_str", None)
        self.input_preprocessor = InputPreprocessor(
            model_config, self.tokenizer, self.processor, limits, chat_renderer=self.built.chat_renderer(),
            placeholder=(lambda i: get_placeholder("image", i)) if get_placeholder else None,
            video_placeholder=self._video_placeholder(get_placeholder),
        )  # fmt: skip
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_output = StructuredOutputManager(self.tokenizer, text_config.vocab_size, self.eos_token_ids)
        self._profiling = False
        self._profile_run()

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
        inputs = self.process_inputs(prompt, params)
        max_tokens = min(params.max_tokens or self.max_model_len, self.max_model_len - len(inputs.token_ids))
        arrival_time = arrival_time or time.monotonic()
        children = []
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            child_params = dataclasses.replace(params, n=1, seed=seed, max_tokens=max_tokens)
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            children.append(
                Request(
                    child_id,
                    inputs.token_ids,
                    child_params,
                    eos_token_ids=self.eos_token_ids,
                    mm_items=inputs.mm_items,
                    prompt=inputs.prompt,
                    arrival_time=arrival_time,
                    parent_id=request_id,
                    index=index,
                )
            )
            if params.structured_outputs is not None:  # the grammar is compiled (and cached) by now
                children[-1].structured_output = self.structured_output.new_request(params.structured_outputs)
        self.output_processor.add(request_id, inputs, children)
        for child in children:
            self.scheduler.add_request(child)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free what it holds; it produces no further output."""
        for child in self.output_processor.children(request_id):
            if not child.is_finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
        self.output_processor.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- stepping -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: schedule -> run the model -> `Scheduler.update_from_output` -> outputs of the
        requests it advanced (finished ones for the last time).

        A failure while running the model fails the requests of this step (finish reason "error",
        `RequestOutput.error` says why) and leaves the engine serving the others; a failure making
        one request's output fails that request only. Only a failure of the scheduler itself (the
        engine's own state) and `WorkerDiedError` (a tensor-parallel rank died) propagate."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("No request could be scheduled; the KV cache is too small for the waiting ones")
            return []
        try:
            sampled = self.runner.execute(out, self.block_manager, self.encoder_cache)
        except WorkerDiedError:  # the ranks are out of step: no step can run any more
            raise
        except EncoderInputError as e:
            if self._profiling:  # the model's own worst case: the configuration cannot run, as below
                raise e.first
            return self._fail_encoder_inputs(out, e)
        except Exception as e:
            if self._profiling:  # the configuration cannot run at all: say so at start-up
                raise
            logger.exception("The model failed on a step of %d request(s); failing them", len(out.scheduled))
            return self._fail({step.request.parent_id: None for step in out.scheduled}, e)
        advanced: dict[str, None] = {}
        failed: dict[str, BaseException] = {}
        for request in self.scheduler.update_from_output(out, sampled):
            try:
                stop_string = self.output_processor.add_token(request)
                if stop_string is not None:
                    self._stop_on_string(request, stop_string)
                advanced[request.parent_id] = None
            except Exception as e:  # e.g. the detokenizer on one request's tokens: that request only
                logger.exception("Making the output of request %s failed; failing it", request.request_id)
                failed[request.parent_id] = e
        outputs = [self.output_processor.output(parent_id) for parent_id in advanced if parent_id not in failed]
        for parent_id, e in failed.items():
            outputs += self._fail({parent_id: None}, e)
        return outputs

    def _fail_encoder_inputs(self, out: SchedulerOutput, error: EncoderInputError) -> list[RequestOutput]:
        """Fail the requests whose items the encoder could not take (their processed inputs do not fit the
        model: a 400, as bad input). The step's other requests did not run: the next step runs them, their
        items' encoder outputs cached by now."""
        bad = {
            step.request.parent_id: None
            for step in out.scheduled
            if any(item.hash in error.failed for item in step.encode) or any(h in error.failed for h in step.shared)
        }
        logger.warning("The encoder could not take the items of %d request(s); failing them: %s", len(bad), error)
        message = (
            f"The model could not encode this request's items ({error}): the processed inputs do not fit the "
            "model. Check the request's mm_processor_kwargs (options such as patch_size or the tile size must "
            "stay the model's own)."
        )
        return self._fail(bad, error, message=message, status=400)

    def _stop_on_string(self, request: Request, stop_string: str) -> None:
        request.stop_reason = stop_string
        if request.is_finished:  # it also reached its length limit: the stop string is the reason
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            request.metrics.finished_time = time.monotonic()
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)

    def _fail(
        self, parent_ids: Mapping[str, None], error: BaseException, *, message: Optional[str] = None, status: int = 500
    ) -> list[RequestOutput]:
        """End these requests (all their sequences) with finish reason "error" and free what they hold;
        `message` (default: the error's type) and `status` (500: the engine's fault; 400: the request's
        inputs) go to RequestOutput.error / error_status."""
        outputs = []
        for parent_id in parent_ids:
            if parent_id not in self.output_processor:
                continue
            for child in self.output_processor.children(parent_id):
                if not child.is_finished:
                    child.metrics.finished_time = time.monotonic()
                    self.scheduler.finish(child, RequestStatus.FINISHED_ERROR)
            self.output_processor.fail(
                parent_id, message or f"The engine failed while running this request ({type(error).__name__}).", status
            )
            outputs.append(self.output_processor.output(parent_id))
        return outputs

    def check_health(self) -> None:
        """Raise `WorkerDiedError` if a tensor-parallel worker has died."""
        if self.workers is not None:
            self.workers.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step afterwards)."""
        if self.workers is not None:
            self.workers.shutdown()

    # ---- start-up ---------------------------------------------------------------------------------

    def _profile_run(self) -> None:
        """Run a worst-case step once (the most items a prompt may carry, each of maximum size), so
        that a configuration that cannot run fails at start-up; then forget it."""
        if self.processor is None:
            return
        info = self.processor.info
        max_items = MultiModalProfiler(self.processor).get_mm_max_tokens_per_item(self.max_model_len)
        max_tokens = min(self.max_model_len, self.num_blocks * self.cache_config.block_size) - 2
        # The most items that fit the encoder budget and the KV cache together, the largest
        # modality first (at least one of it, so that an item too large fails here); with several
        # modalities (images and videos) the others fill what it leaves.
        left = min(self.encoder_budget, max_tokens)
        counts = {}
        limits = info.get_allowed_mm_limits()
        for modality in sorted((m for m in limits if limits[m] > 0), key=lambda m: -max_items.get(m, 1)):
            size = max(max_items.get(modality, 1), 1)
            count = min(limits[modality], left // size) if counts else min(limits[modality], max(1, left // size))
            if count > 0:
                counts[modality] = count
                left -= count * size
        dummy = self.processor.dummy_inputs.get_dummy_processor_inputs(self.max_model_len, counts)
        start = time.perf_counter()
        try:
            self.add_request("__profile__", {"prompt": dummy.prompt_text, "multi_modal_data": dummy.mm_data},
                             SamplingParams(max_tokens=1, temperature=0.0))  # fmt: skip
        except ValueError as e:
            raise ValueError(f"The engine cannot run a worst-case prompt with this configuration: {e}") from e
        self._profiling = True
        try:
            while self.has_unfinished_requests():
                self.step()
        finally:
            self._profiling = False
            self.output_processor.forget("__profile__")
        self.scheduler.reset()  # no request, no cached block or encoder output: as if new
        logger.info("Profile run with %s: %.2f s", counts, time.perf_counter() - start)


def _eos_token_ids(tokenizer: Any, *configs: Any) -> frozenset[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for config in configs:
        eos = getattr(config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)
