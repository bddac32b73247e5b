"""Continuous batching: which requests run how many tokens in the next step.

Each step has a token budget shared by decode tokens and prompt chunks (chunked prefill), and a
vision-encoder budget. Running requests go first, in arrival order; waiting ones are admitted
while budget, sequence slots and KV blocks last. When blocks run out, the most recently admitted
running request is preempted: its blocks are freed and it is recomputed later (its prefix blocks
usually still cached), so nothing crashes and nothing is lost.

With a KV window W (every attention layer of the model windowed, W the largest window), a request's
blocks wholly before its last W tokens are released after each step it runs: no later query of it
sees them, so they no longer count against the cache.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from ...config import SchedulerConfig
from .block_manager import BlockManager
from .encoder_cache import EncoderCache
from .request import MultiModalItem, Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    encode: list[MultiModalItem] = field(default_factory=list)
    """Items whose encoder output this step needs and the encoder cache lacks."""

    shared: list[str] = field(default_factory=list)
    """Hashes of items this request needs that another request encodes this step."""

    cached: list[MultiModalItem] = field(default_factory=list)
    """Items this request needs that the encoder cache holds."""

    snapshots: list[tuple[int, int]] = field(default_factory=list)
    """Hybrid models: (block boundary within the step's tokens, snapshot row): the stateful layers write the
    request's state there to the row (the rows are taken when the step is committed)."""

    snapshot_ends: list[int] = field(default_factory=list)
    """The boundaries planned, before rows are taken."""


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    encoder_users: dict[str, set[str]] = field(default_factory=dict)
    """Item hash -> ids of the requests that need the encoder output computed this step."""

    finished_ids: set[str] = field(default_factory=set)
    """Requests that ended since the last step: the runner drops what it keeps for them."""

    state_restores: list[tuple[int, int]] = field(default_factory=list)
    """Hybrid models: (snapshot row, slot) of the requests admitted on a prefix-cache hit, copied before the step."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        encoder_cache: EncoderCache,
        encoder_budget: int,
        max_model_len: Optional[int] = None,
        *,
        kv_window: Optional[int] = None,
    ) -> None:
        """`kv_window`: release blocks no query can see any more (see the module's docstring); None
        keeps every block of a request until it ends."""
        self.config = config
        self.kv_window = kv_window
        self.max_model_len = max_model_len or config.max_model_len
        self.block_manager = block_manager
        self.encoder_cache = encoder_cache
        self.encoder_budget = encoder_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._rows: dict[str, int] = {}  # embedding rows of items being encoded
        self._finished_ids: set[str] = set()  # ended since the last schedule (SchedulerOutput.finished_ids)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        token_budget = self.config.max_num_batched_tokens
        self._rows.clear()
        encoding: dict[str, set[str]] = {}  # item hash -> requests needing it, encoded this step
        scheduled: list[ScheduledRequest] = []
        restores: list[tuple[int, int]] = []
        preempted = False

        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
            step = self._plan(request, request.num_computed_tokens, num_new, encoding)
            if step is None:
                i += 1
                continue
            while not self.block_manager.allocate(request, step.num_new_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                self._commit(step, encoding, scheduled)
                token_budget -= step.num_new_tokens
                i += 1

        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            request = self.waiting[0]
            cached = self.block_manager.find_cached_prefix(request)
            start = len(cached) * self.block_manager.block_size
            step = self._plan(request, start, min(request.num_tokens - start, token_budget), encoding)
            if step is None or not self.block_manager.allocate(request, step.num_new_tokens, cached):
                break
            self.waiting.popleft()
            request.num_computed_tokens = start
            restore = self.block_manager.take_state_restore(request)
            if restore is not None:  # its state continues from the snapshot at the end of the cached prefix
                restores.append((restore, self.block_manager.state_slot_of(request)))
            if self.kv_window is not None:  # cached blocks before the first key this step sees
                self.block_manager.release_before(request, start - self.kv_window + 1)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._commit(step, encoding, scheduled)
            token_budget -= step.num_new_tokens
        now = time.monotonic()  # queue time ends here, before the step runs (vLLM's scheduled timestamp)
        for step in scheduled:
            step.request.metrics.first_scheduled_time = step.request.metrics.first_scheduled_time or now
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(scheduled, encoding, finished, restores)

    def _plan(
        self, request: Request, start: int, num_new: int, encoding: dict[str, set[str]]
    ) -> ScheduledRequest | None:
        """How many of `num_new` tokens from `start` can run, given the encoder budget and cache;
        a chunk stops before an image that cannot be encoded in this step."""
        used = sum(self._rows[h] for h in encoding)
        budget_left = self.encoder_budget - used
        step = ScheduledRequest(request, num_new)
        for item in request.items_overlapping(start, start + num_new):
            if item.hash in encoding or any(item.hash == i.hash for i in step.encode):
                continue  # encoded this step already (for another request, or a repeat in this one)
            if item.hash in self.encoder_cache.entries:  # referenced once the step is committed
                step.cached.append(item)
                continue
            pending = used + sum(i.num_embeds for i in step.encode)
            if item.num_embeds > budget_left or not self.encoder_cache.can_fit(item.num_embeds, pending):
                step.num_new_tokens = max(0, item.start - start)
                break
            step.encode.append(item)
            budget_left -= item.num_embeds
        if self.config.disable_chunked_mm_input:
            step.num_new_tokens = self._stop_before_split_item(
                request, start, step.num_new_tokens, self.config.whole_item_modalities
            )
        if step.num_new_tokens == 0:
            return None
        end = start + step.num_new_tokens
        step.snapshot_ends = self.block_manager.snapshot_boundaries(request, start, step.num_new_tokens)
        step.encode = [item for item in step.encode if item.start < end]
        step.cached = [item for item in step.cached if item.start < end]
        step.shared = [i.hash for i in request.items_overlapping(start, end) if i.hash in encoding]
        return step

    @staticmethod
    def _stop_before_split_item(
        request: Request, start: int, num_new: int, modalities: Optional[tuple[str, ...]] = None
    ) -> int:
        """`num_new` cut so the chunk does not end inside an item (of `modalities`; None: any): before the item,
        or nothing if the chunk starts inside it (a prefix-cache hit) and cannot reach its end."""
        end = start + num_new
        for item in request.items_overlapping(start, end):
            if item.end > end and (modalities is None or item.modality in modalities):
                return max(0, item.start - start)
        return num_new

    def _commit(self, step: ScheduledRequest, encoding: dict[str, set[str]], scheduled: list) -> None:
        for end in step.snapshot_ends:
            row = self.block_manager.states.reserve_snapshot()
            if row is not None:
                step.snapshots.append((end, row))
        for item in step.encode:
            encoding.setdefault(item.hash, set()).add(step.request.request_id)
            self._rows[item.hash] = item.num_embeds
        for item_hash in step.shared:
            encoding[item_hash].add(step.request.request_id)
        for item in step.cached:
            self.encoder_cache.lookup(item.hash, step.request.request_id)
        scheduled.append(step)

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        self.encoder_cache.release(request.request_id)
        request.num_computed_tokens = 0
        request.hidden_parts.clear()  # recomputed from the start
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: Mapping[str, tuple[int, Optional[dict[int, float]]]],
        hidden: Mapping[str, Any] = {},
    ) -> list[Request]:
        """After a step ran: advance each scheduled request, cache its full blocks, release those out of
        the KV window and the encoder outputs it has consumed, append its sampled token and end it on
        EOS, a stop token id or its length limit (stop strings need text: the output processor decides those);
        a pooling request keeps its `hidden` rows and ends once its prompt is computed, its blocks freed.
        Returns the requests that got a token or ended pooling, in schedule order."""
        now = time.monotonic()
        advanced = []
        for step in out.scheduled:
            request = step.request
            request.num_computed_tokens += step.num_new_tokens
            self.block_manager.cache_full_blocks(request)
            for end, row in step.snapshots:  # the state at each boundary is in its row now
                self.block_manager.publish_snapshot(request, end, row)
            if self.kv_window is not None:  # the next query, at >= n, sees keys from n - W + 1 on
                self.block_manager.release_before(request, request.num_computed_tokens - self.kv_window + 1)
            for item in request.mm_items:
                if item.end <= request.num_computed_tokens:
                    self.encoder_cache.release_item(item.hash, request.request_id)
            if request.request_id in sampled:
                self._append_token(request, *sampled[request.request_id], now)
                advanced.append(request)
            elif request.request_id in hidden:
                request.hidden_parts.append(hidden[request.request_id])
                if request.num_computed_tokens == request.num_tokens:
                    request.metrics.finished_time = now
                    self.finish(request, RequestStatus.FINISHED_STOPPED)
                    advanced.append(request)
        return advanced

    def _append_token(self, request: Request, token: int, logprobs: Optional[dict[int, float]], now: float) -> None:
        request.output_token_ids.append(token)
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        metrics = request.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.num_output_tokens = len(request.output_token_ids)
        metrics.token_times.append(now)
        params = request.sampling_params
        grammar = request.structured_output
        if grammar is not None and not grammar.accept(token):
            logger.warning("Request %s: token %d is outside its grammar", request.request_id, token)
        status = None
        if not params.ignore_eos and token in request.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif grammar is not None and grammar.is_terminated:  # the output is complete
            status = RequestStatus.FINISHED_STOPPED
        elif token in params.stop_token_ids:
            status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif len(request.output_token_ids) >= params.max_tokens or (
            self.max_model_len is not None and request.num_tokens >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            metrics.finished_time = now
            self.finish(request, status)

    def reset(self) -> None:
        """Forget everything (after the start-up profile run): no request, no cached block or
        encoder output, counters at zero. The objects stay, so whoever holds them sees the reset."""
        for request in [*self.running, *self.waiting]:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        self.block_manager.reset()
        self.encoder_cache.reset()
        self.num_preemptions = 0

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request and free what it holds."""
        request.status = status
        self._finished_ids.add(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        self.encoder_cache.release(request.request_id)
