"""The engine core: processed requests in, one scheduled step at a time, new tokens out (vLLM v1's
EngineCore).

It is the in-thread `EngineCoreClient` (core_client.py). It owns what a step touches: the scheduler with
its KV block manager and encoder cache, the model runner (and the tensor-parallel workers behind it), the
grammar matchers. It knows nothing of prompts
or text: requests reach it processed (`EngineCoreRequest`), and each step returns every advanced
sequence's new token and, if the core ended it, why (`EngineCoreOutput`). The front-ends
(`LLMEngine` in-process, `AsyncEngine` for the server) own the input preprocessor and the output
processor. Request state changes in the scheduler only: `Scheduler.update_from_output` after a step,
`Scheduler.finish` for what a front-end asks (aborts, stop strings).

At start-up it runs a worst-case step (so a configuration that cannot run fails there) and reports what
a front-end needs as `info` (`EngineCoreInfo`), as vLLM's core's ready message does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Optional, Protocol

import torch

from ...config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from ...distributed import get_tp_group, tensor_parallel_group
from ...errors import WorkerDiedError
from ...layers.kv_cache import kv_cache_bytes_per_block, kv_window
from ...layers.pooler import pool
from ...layers.state_cache import state_bytes_per_slot
from ...models.factory import build_model
from ...multimodal.profiling import MultiModalProfiler
from ...pooling_params import PoolerConfig, PoolingParams
from ...sampling_params import SamplingParams
from ...tokenizer_utils import load_tokenizer
from .block_manager import BlockManager
from .core_io import EngineCoreInfo, EngineCoreOutput, EngineCoreRequest, EngineLimits
from .encoder_cache import EncoderCache
from .lora_manager import LoRAManager
from .model_runner import EncoderInputError, ModelRunner, TensorParallelRanks
from .request import Request, RequestStatus, processed_items
from .scheduler import Scheduler, SchedulerOutput
from .state_slots import StateSlots, plan_state_rows
from .structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

PROFILE_REQUEST = "__profile__"


class TensorParallelWorkers(TensorParallelRanks, Protocol):
    """The other tensor-parallel ranks (`executor.workers.WorkerGroup`), started before the core."""

    group: Any  # the process group this rank joins for the language model's layers
    on_death: list[Callable[[BaseException], None]]

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class EngineCore:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: Optional[CacheConfig] = None,
        scheduler_config: Optional[SchedulerConfig] = None,
        parallel_config: Optional[ParallelConfig] = None,
        *,
        workers: Optional[TensorParallelWorkers] = None,
    ) -> None:
        """`workers`: the other tensor-parallel ranks, already started (`executor.start_core` starts them);
        the core shuts them down with itself, also when it fails to start."""
        self.model_config = model_config
        self.cache_config = cache_config = cache_config or CacheConfig()
        self.scheduler_config = scheduler_config = scheduler_config or SchedulerConfig()
        self.parallel_config = parallel_config or ParallelConfig()
        self.workers = workers
        try:
            self.tokenizer = load_tokenizer(model_config)
            self._init(model_config, cache_config, scheduler_config)
        except BaseException:
            self.shutdown()
            raise

    def _init(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> None:
        group = self.workers.group if self.workers is not None else get_tp_group()
        with tensor_parallel_group(group):  # the language model's layers take this rank's slice
            self.built = build_model(model_config, self.tokenizer)
        self.model, self.processor = self.built.model, self.built.processor
        self.loras = LoRAManager(self.model, model_config.max_loras, tensor_parallel=self.workers is not None)
        self.pooler_config = self._pooler_config(model_config)
        if self.pooler_config is not None and self.pooler_config.pooling_type != "LAST":  # every token's state
            cache_config = dataclasses.replace(cache_config, enable_prefix_caching=False)  # (not the caller's)
            self.cache_config = cache_config

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
        self.encoder_cache = EncoderCache(cache_config.encoder_cache_size or self.encoder_budget)

        # A hybrid model's non-attention layers keep a state per running sequence (and snapshots of it for
        # prefix caching), taken from the KV budget first.
        row_bytes = state_bytes_per_slot(self.model, model_config.dtype)
        num_slots, num_snapshots = 0, 0
        if row_bytes:
            num_slots, num_snapshots = plan_state_rows(
                cache_config.kv_cache_memory, row_bytes, scheduler_config.max_num_seqs,
                cache_config.enable_prefix_caching,
            )  # fmt: skip
        self.num_state_rows = num_slots + num_snapshots
        state_memory = self.num_state_rows * row_bytes
        block_bytes = kv_cache_bytes_per_block(self.model, cache_config.block_size, model_config.dtype)
        self.num_blocks = num_blocks = (cache_config.kv_cache_memory - state_memory) // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {cache_config.kv_cache_memory} B holds no block of {block_bytes} B")
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB)",
            num_blocks, cache_config.block_size, num_blocks * cache_config.block_size, num_blocks * block_bytes / 2**20,
        )  # fmt: skip
        states = None
        if row_bytes:
            logger.info(
                "Recurrent state: %d sequences and %d prefix snapshots of %.2f MiB (%.1f MiB)",
                num_slots, num_snapshots, row_bytes / 2**20, state_memory / 2**20,
            )  # fmt: skip
            states = StateSlots(num_slots, num_snapshots)
        self.block_manager = BlockManager(
            num_blocks, cache_config.block_size, enable_prefix_caching=cache_config.enable_prefix_caching, states=states
        )
        if getattr(self.model, "is_mm_prefix_lm", False) and not scheduler_config.disable_chunked_mm_input:
            # a chunk ending inside an image lacks its later tokens; the caller's config object is not changed
            modalities = getattr(self.model, "bidirectional_modalities", None)
            scheduler_config = dataclasses.replace(scheduler_config, disable_chunked_mm_input=True,
                                                   whole_item_modalities=modalities and tuple(modalities))  # fmt: skip
            self.scheduler_config = scheduler_config
        self.kv_window = kv_window(self.model) if cache_config.free_out_of_window_blocks else None
        self.scheduler = Scheduler(
            scheduler_config, self.block_manager, self.encoder_cache, self.encoder_budget, self.max_model_len,
            kv_window=self.kv_window,
        )  # fmt: skip
        self.runner = ModelRunner(
            self.model,
            num_blocks=num_blocks,
            block_size=cache_config.block_size,
            dtype=model_config.dtype,
            device=model_config.device,
            workers=self.workers,
            num_state_rows=self.num_state_rows,
        )
        self.structured_output = StructuredOutputManager(self.tokenizer, text_config.vocab_size, self.eos_token_ids)
        limits = EngineLimits(
            max_model_len=self.max_model_len,
            encoder_rows=min(self.encoder_budget, self.encoder_cache.capacity),
            kv_tokens=num_blocks * cache_config.block_size,
            whole_item_tokens=(
                scheduler_config.max_num_batched_tokens if scheduler_config.disable_chunked_mm_input else None
            ),
            whole_item_modalities=scheduler_config.whole_item_modalities,
        )
        self.info = EngineCoreInfo(limits, self.eos_token_ids)
        self.requests: dict[str, Request] = {}  # sequence id -> its state, until it ends
        self._profiling = False
        self._profile_run()

    def _pooler_config(self, model_config: ModelConfig) -> Optional[PoolerConfig]:
        """How a pooling model pools (the config's, the model class's, the folder's); None when generating. A model
        that only pools refuses the generate runner."""
        runners = getattr(self.model, "runners", ("generate", "pooling"))
        if model_config.runner not in runners:
            raise ValueError(f"{type(self.model).__name__} runs with runner={runners[0]!r} only; "
                             f"got runner={model_config.runner!r}.")  # fmt: skip
        if model_config.runner != "pooling":
            return None
        default = getattr(self.model, "default_pooler_config", None)
        return model_config.pooler_config or default or PoolerConfig.from_folder(model_config.model)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a processed sequence. An invalid output constraint raises InputError, queueing nothing."""
        if request.request_id in self.requests:
            raise ValueError(f"Sequence id {request.request_id!r} is already in the engine")
        params = request.sampling_params
        if params.lora is not None:
            in_use = (r.sampling_params.lora.lora_int_id for r in self.requests.values() if r.sampling_params.lora)
            self.loras.activate(params.lora, in_use)
        items = self.loras.items_for(params.lora, request.mm_items) if params.lora else request.mm_items
        state = Request(
            request.request_id,
            request.prompt_token_ids,
            params,
            eos_token_ids=self.eos_token_ids,
            mm_items=items,
            arrival_time=request.arrival_time,
            prompt_embeds=request.prompt_embeds,
        )
        if params.structured_outputs is not None:  # compiled once per constraint, then cached
            state.structured_output = self.structured_output.new_request(params.structured_outputs)
        self.requests[request.request_id] = state
        self.scheduler.add_request(state)

    def abort(self, request_ids: Iterable[str], *, stopped: bool = False) -> None:
        """End these sequences and free what they hold (`stopped`: a front-end found a stop string, so they
        end as stopped; else aborted). Ids the core no longer has are ignored."""
        status = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_ABORTED
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None and not request.is_finished:
                request.metrics.finished_time = time.monotonic()
                self.scheduler.finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- stepping -------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """One step: schedule -> run the model -> `Scheduler.update_from_output` -> the advanced sequences'
        new tokens (ended ones for the last time).

        A failure while running the model fails the sequences of this step (status FINISHED_ERROR, `error`
        says why) and leaves the core serving the others. Only a failure of the scheduler itself (the core's
        own state) and `WorkerDiedError` (a tensor-parallel rank died) propagate."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("No request could be scheduled; the KV cache is too small for the waiting ones")
            return []
        try:
            sampled, hidden = self.runner.execute(out, self.block_manager, self.encoder_cache)
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
            message = f"The engine failed while running this request ({type(e).__name__})."
            return self._fail([step.request for step in out.scheduled], message, 500)
        outputs = []
        for request in self.scheduler.update_from_output(out, sampled, hidden):
            logprobs = request.output_logprobs[-1:] if request.sampling_params.logprobs is not None else None
            output = EngineCoreOutput(request.request_id, request.output_token_ids[-1:], logprobs, request.metrics,
                                      request.status if request.is_finished else None, request.stop_reason)  # fmt: skip
            pooling = request.sampling_params.pooling
            if pooling is not None:  # ended: its prompt is computed
                output.pooled = pool(torch.cat(request.hidden_parts), self.pooler_config, pooling)
                request.hidden_parts.clear()
            outputs.append(output)
            if request.is_finished:
                del self.requests[request.request_id]
        return outputs

    def _fail_encoder_inputs(self, out: SchedulerOutput, error: EncoderInputError) -> list[EngineCoreOutput]:
        """Fail the sequences whose items the encoder could not take (their processed inputs do not fit the
        model: a 400, as bad input). The step's other sequences did not run: the next step runs them, their
        items' encoder outputs cached by now."""
        bad = [
            step.request
            for step in out.scheduled
            if any(item.hash in error.failed for item in step.encode) or any(h in error.failed for h in step.shared)
        ]
        logger.warning("The encoder could not take the items of %d request(s); failing them: %s", len(bad), error)
        message = (
            f"The model could not encode this request's items ({error}): the processed inputs do not fit the "
            "model. Check the request's mm_processor_kwargs (options such as patch_size or the tile size must "
            "stay the model's own)."
        )
        return self._fail(bad, message, 400)

    def _fail(self, requests: list[Request], message: str, status: int) -> list[EngineCoreOutput]:
        """End these sequences with FINISHED_ERROR and free what they hold."""
        outputs = []
        for request in requests:
            if request.is_finished:
                continue
            request.metrics.finished_time = time.monotonic()
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            self.requests.pop(request.request_id, None)
            outputs.append(
                EngineCoreOutput(request.request_id, [], None, request.metrics, RequestStatus.FINISHED_ERROR,
                                 error=message, error_status=status)  # fmt: skip
            )
        return outputs

    # ---- state, health, end -----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """The scheduler's and caches' counters, plain numbers (summable over replicas): sequences running /
        waiting, KV blocks used / total, recurrent-state slots used / total (hybrid models), prefix-cache queries /
        hits (tokens), encoder-cache and processor-cache queries / hits (items), preemptions."""
        blocks, scheduler, encoder = self.block_manager, self.scheduler, self.encoder_cache
        processor_cache = getattr(self.processor, "cache", None)
        processor = processor_cache.stats if processor_cache is not None else None
        return {
            "running": len(scheduler.running),
            "waiting": len(scheduler.waiting),
            "kv_blocks_used": blocks.num_blocks - blocks.num_free_blocks,
            "kv_blocks_total": blocks.num_blocks,
            "state_slots_used": blocks.states.num_used if blocks.states else 0,
            "state_slots_total": blocks.states.num_slots if blocks.states else 0,
            "prefix_cache_queries": blocks.prefix_queries,
            "prefix_cache_hits": blocks.prefix_hits,
            "encoder_cache_queries": encoder.queries,
            "encoder_cache_hits": encoder.hits,
            "processor_cache_queries": processor.queries if processor is not None else 0,
            "processor_cache_hits": processor.hits if processor is not None else 0,
            "num_preemptions": scheduler.num_preemptions,
        }

    def replica_stats(self) -> list[dict[str, int]]:
        return [self.stats()]

    def wake(self) -> None:
        """Nothing to wake: `step()` never waits."""

    def watch(self, on_death: Callable[[BaseException], None]) -> None:
        """Call `on_death(error)` when a tensor-parallel worker dies (from the workers' monitor thread)."""
        if self.workers is not None:
            self.workers.on_death.append(on_death)

    def check_health(self) -> None:
        """Raise `WorkerDiedError` if a tensor-parallel worker has died."""
        if self.workers is not None:
            self.workers.check_health()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (the core cannot step afterwards)."""
        if self.workers is not None:
            self.workers.shutdown()

    # ---- start-up ---------------------------------------------------------------------------------

    def _profile_run(self) -> None:
        """Run a worst-case step once (the most items a prompt may carry, each of maximum size), so that a
        configuration that cannot run fails at start-up; then forget it."""
        if self.processor is None:
            return
        info = self.processor.info
        max_items = MultiModalProfiler(self.processor).get_mm_max_tokens_per_item(self.max_model_len)
        max_tokens = min(self.max_model_len, self.num_blocks * self.cache_config.block_size) - 2
        # The most items that fit the encoder budget and the KV cache together, the largest modality
        # first (at least one of it, so that an item too large fails here); with several modalities
        # (images and videos) the others fill what it leaves.
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
        processed = self.processor.apply(dummy.prompt_text, dummy.mm_data, {})
        token_ids, items = processed["prompt_token_ids"], processed_items(processed)
        try:
            self.info.limits.check(token_ids, items, 1)
        except ValueError as e:
            largest = ", ".join(f"{n} {m}{'s' if n > 1 else ''} of up to {max_items.get(m, 0)} tokens"
                                for m, n in counts.items())  # fmt: skip
            raise ValueError(
                f"The engine cannot run a worst-case prompt with this configuration ({largest}): {e} Make the "
                "largest item smaller with mm_processor_kwargs (e.g. a smaller max_pixels / size), allow fewer with "
                "limit_mm_per_prompt, or give the model a longer max_model_len."
            ) from e
        pooling = PoolingParams() if self.pooler_config is not None else None  # a pooling model's step pools
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling)
        self.add_request(EngineCoreRequest(PROFILE_REQUEST, token_ids, params, items))
        self._profiling = True
        try:
            while self.has_unfinished_requests():
                self.step()
        finally:
            self._profiling = False
            self.requests.pop(PROFILE_REQUEST, None)
        self.scheduler.reset()  # no request, no cached block or encoder output: as if new
        logger.info("Profile run with %s: %.2f s", counts, time.perf_counter() - start)


def _eos_token_ids(tokenizer: Any, *configs: Any) -> frozenset[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for config in configs:
        eos = getattr(config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)
