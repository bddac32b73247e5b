"""Runs one scheduled step on the model: encoder for new items, merge, decoder, sampler.

Tokens of all scheduled requests are flattened into one batch (`ModelInputs`, what every
tensor-parallel rank runs; the encoder runs here, on rank 0 only). For each prompt chunk, the rows
of the encoder outputs that fall in the chunk (by the placeholders' is_embed masks) replace the
text embeddings at those positions, so an image split across chunks is encoded once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import torch

from ...errors import WorkerDiedError
from ...layers.cpu_kernels import describe_cpu_kernels
from ...layers.kv_cache import allocate_kv_cache
from ...layers.linear import pack_linears_for_cpu
from ...layers.lora import lora_rows
from ...layers.sampler import SamplerOutput, sample
from ...layers.state_cache import allocate_state_cache
from ...models.interfaces import supports_mrope, supports_multimodal
from ...models.mrope_positions import decode_positions
from ...multimodal.inputs import MultiModalKwargs
from ...multimodal.utils import group_by_modality
from .block_manager import BlockManager
from .encoder_cache import EncoderCache
from .model_inputs import ModelInputs, run_model
from .request import MultiModalItem, Request
from .scheduler import SchedulerOutput
from .structured_output import token_mask

logger = logging.getLogger(__name__)


class TensorParallelRanks(Protocol):
    """The other tensor-parallel ranks, as the runner drives them (`workers.WorkerGroup`)."""

    def start_model(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> None: ...

    def run_model(self, run_local: Callable[[], Any], inputs: Any) -> Any: ...


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str,
        workers: Optional[TensorParallelRanks] = None,
        num_state_rows: int = 0,
    ) -> None:
        """`workers`: the other tensor-parallel ranks (this runner is rank 0), None with one rank;
        `num_state_rows`: rows of a hybrid model's non-attention state (running sequences and snapshots)."""
        self.model, self.block_size, self.device, self.workers = model, block_size, device, workers
        self.num_state_rows = num_state_rows
        self.uses_mrope = supports_mrope(model)
        # M-RoPE models: each request's prompt positions [3, P] and decode delta, computed on its first
        # step and kept (through preemption and recomputation) until the scheduler says it ended
        self.mrope_positions: dict[str, tuple[torch.Tensor, int]] = {}
        self.is_mm_prefix_lm = bool(getattr(model, "is_mm_prefix_lm", False))
        self.bidirectional_modalities = getattr(model, "bidirectional_modalities", None)  # None: every modality
        if workers is not None:  # the workers allocate the same cache over their heads
            workers.start_model(num_blocks, block_size, dtype)
        prepare_model_for_steps(model, num_blocks, block_size, dtype, device)
        if num_state_rows:
            allocate_state_cache(model, num_state_rows, dtype, device)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_manager: BlockManager, encoder_cache: EncoderCache
    ) -> tuple[dict[str, tuple[int, Optional[dict[int, float]]]], dict[str, torch.Tensor]]:
        """Run the step; returns (request id -> (sampled token, logprobs) for the requests whose computed tokens
        reach their end (chunks in the middle of a prompt sample nothing), pooling request id -> the final hidden
        states [n, hidden] of its tokens this step)."""
        for request_id in out.finished_ids:
            self.mrope_positions.pop(request_id, None)
        self._encode(out, encoder_cache)
        inputs, sampling, pooling = self._prepare(out, block_manager, encoder_cache)
        if self.workers is None:
            logits, pooled = run_model(self.model, inputs, self.block_size, self.device)
        else:
            run = lambda: run_model(self.model, inputs, self.block_size, self.device)  # noqa: E731
            logits, pooled = self.workers.run_model(run, inputs)
        hidden = dict(zip([r.request_id for r, _ in pooling], pooled.split([n for _, n in pooling]))) if pooling else {}
        if logits is None:
            return {}, hidden
        # the grammars' bitmask is filled on the CPU while the device runs the step (launched above)
        mask = token_mask(sampling)
        result: SamplerOutput = sample(
            logits, [r.sampling_params for r in sampling], [r.generator for r in sampling], mask
        )
        sampled = {
            request.request_id: (token, logprobs)
            for request, token, logprobs in zip(sampling, result.token_ids, result.logprobs)
        }
        return sampled, hidden

    def _prepare(
        self, out: SchedulerOutput, block_manager: BlockManager, encoder_cache: EncoderCache
    ) -> tuple[ModelInputs, list[Request], list[tuple[Request, int]]]:
        """The step's `ModelInputs` (what every rank runs), the requests sampled, in row order, and the pooling
        requests with their rows this step."""
        ids: list[int] = []
        positions: list[torch.Tensor] = []  # per request: [n] or, for M-RoPE, [3, n]
        is_multimodal, rows, sample_rows, sampling, pool_rows, pooling = [], [], [], [], [], []
        lora_ids: list[int] = []
        embeds_at, embeds_rows = [], []  # prompt_embeds: (step row, count) and the rows replacing those embeddings
        for step in out.scheduled:
            request, start = step.request, step.request.num_computed_tokens
            end = start + step.num_new_tokens
            ids += request.all_token_ids[start:end]
            positions.append(self._positions(request, start, end))
            mask = torch.zeros(end - start, dtype=torch.bool)
            for item in request.items_overlapping(start, end):
                item_mask, item_rows = item.embed_rows(start, end)
                lo = max(start, item.start) - start
                mask[lo : lo + len(item_mask)] = item_mask
                rows.append(encoder_cache.get(item.hash)[item_rows])
            is_multimodal.append(mask)
            if request.prompt_embeds is not None and start < request.num_prompt_tokens:
                stop = min(end, request.num_prompt_tokens)
                embeds_at.append((len(ids) - (end - start), stop - start))
                embeds_rows.append(request.prompt_embeds[start:stop])
            lora = request.sampling_params.lora
            lora_ids += [lora.lora_int_id if lora is not None else 0] * (end - start)
            if request.sampling_params.pooling is not None:  # every row: the pooler picks (last, mean, ...)
                pool_rows += range(len(ids) - (end - start), len(ids))
                pooling.append((request, end - start))
            elif end == request.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampling.append(request)
        multimodal = supports_multimodal(self.model)
        slots = [block_manager.state_slot_of(s.request) for s in out.scheduled] if self.num_state_rows else None
        inputs = ModelInputs(
            input_ids=torch.tensor(ids),
            positions=torch.cat(positions, dim=-1),
            query_lens=[s.num_new_tokens for s in out.scheduled],
            context_lens=[s.request.num_computed_tokens + s.num_new_tokens for s in out.scheduled],
            block_tables=[block_manager.blocks_of(s.request) for s in out.scheduled],
            sample_rows=sample_rows,
            pool_rows=pool_rows,
            lora_ids=lora_ids if any(lora_ids) else None,
            embeds_mask=_rows_mask(len(ids), embeds_at) if embeds_rows else None,
            embeds_rows=torch.cat(embeds_rows) if embeds_rows else None,
            is_multimodal=torch.cat(is_multimodal) if multimodal else None,
            mm_rows=rows if multimodal else None,
            bidirectional_spans=[_item_spans(s.request, self.bidirectional_modalities) for s in out.scheduled]
            if self.is_mm_prefix_lm else None,
            state_slots=slots,
            state_restores=out.state_restores,
            state_snapshots=[(i, end - s.request.num_computed_tokens, row)
                             for i, s in enumerate(out.scheduled) for end, row in s.snapshots],
        )  # fmt: skip
        return inputs, sampling, pooling

    def _positions(self, request: Request, start: int, end: int) -> torch.Tensor:
        """Positions of tokens start..end-1: [n], or [3, n] for an M-RoPE model (the prompt's from
        the model, computed on the request's first step; generated tokens 1-D after the delta)."""
        if not self.uses_mrope:
            return torch.arange(start, end)
        cached = self.mrope_positions.get(request.request_id)
        if cached is None:
            cached = self.mrope_positions[request.request_id] = self.model.get_mrope_input_positions(
                request.prompt_token_ids, request.mm_items
            )
        prompt_positions, delta = cached
        prompt_len = request.num_prompt_tokens
        parts = [prompt_positions[:, start : min(end, prompt_len)]]
        if end > prompt_len:
            parts.append(decode_positions(max(start, prompt_len), end, delta))
        return torch.cat(parts, dim=1)

    def _encode(self, out: SchedulerOutput, encoder_cache: EncoderCache) -> None:
        """Run the encoder once per new item: one call per run of consecutive items of one
        modality, in prompt order (each request's items are sorted by position), so a model that
        takes images and videos gets them in the order the prompt has them. A run the encoder fails
        on is encoded item by item; the items that fail alone raise `EncoderInputError` (the others'
        outputs are cached), so that only the requests holding them fail."""
        items = {item.hash: item for step in out.scheduled for item in step.encode}  # unique, in order
        failed: dict[str, BaseException] = {}
        for _, group in group_by_modality(items.values(), lambda item: (item.modality, item.lora_int_id)):
            try:
                self._encode_items(group, out, encoder_cache)
            except WorkerDiedError:
                raise
            except Exception as e:
                failed.update(self._encode_each(group, out, encoder_cache) if len(group) > 1 else {group[0].hash: e})
        if failed:
            raise EncoderInputError(failed)

    def _encode_each(
        self, items: list[MultiModalItem], out: SchedulerOutput, encoder_cache: EncoderCache
    ) -> dict[str, BaseException]:
        """Encode `items` one at a time; returns the errors of those that fail alone, by item hash."""
        failed: dict[str, BaseException] = {}
        for item in items:
            try:
                self._encode_items([item], out, encoder_cache)
            except WorkerDiedError:
                raise
            except Exception as e:
                failed[item.hash] = e
        return failed

    def _encode_items(self, items: list[MultiModalItem], out: SchedulerOutput, encoder_cache: EncoderCache) -> None:
        kwargs = MultiModalKwargs.from_items([item.kwargs for item in items])
        with lora_rows(items[0].lora_int_id):  # one adapter per group (0: the base model's encoder)
            embeddings = self.model.get_multimodal_embeddings(**kwargs)
        rows = [e.reshape(-1, e.shape[-1]) for e in embeddings]
        for item, item_rows in zip(items, rows):
            if item_rows.shape[0] != item.num_embeds:
                raise RuntimeError(
                    f"The encoder gave {item_rows.shape[0]} embeddings for a {item.modality} with "
                    f"{item.num_embeds} placeholder positions"
                )
        for item, item_rows in zip(items, rows):  # all checked first: a failed run caches nothing
            encoder_cache.put(item.hash, item_rows, out.encoder_users[item.hash])


class EncoderInputError(RuntimeError):
    """The encoder could not encode these items (item hash -> the error), each alone: their processed
    inputs do not fit the model (e.g. processor kwargs that change the patch size the model was built for)."""

    def __init__(self, failed: dict[str, BaseException]) -> None:
        self.failed = failed
        self.first = next(iter(failed.values()))
        super().__init__(f"{type(self.first).__name__}: {self.first}")


def prepare_model_for_steps(
    model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype, device: str
) -> None:
    """Give the model its KV cache and, on CPU, its packed linears (every rank does the same)."""
    allocate_kv_cache(model, num_blocks, block_size, dtype, device)
    if torch.device(device).type == "cpu":
        logger.info(describe_cpu_kernels())
        pack_linears_for_cpu(model)


def _item_spans(request: Request, modalities: Optional[Sequence[str]] = None) -> list[tuple[int, int]]:
    """The runs of item tokens that attend to each other (prefix-LM models), one set per item of `modalities`
    (all if None; Gemma 4: images and videos, not audio): the scheduler keeps each item whole in a chunk. (HF
    groups touching runs of two items into one; prefix-LM prompts never have them, Gemma 3 and 4 wrap each
    picture in its begin/end tokens.)"""
    items = [item for item in request.mm_items if modalities is None or item.modality in modalities]
    return [span for item in items for span in item.embed_spans()]


def _rows_mask(num_rows: int, spans: list[tuple[int, int]]) -> torch.Tensor:
    """[num_rows] bool, True on each (start, count) span."""
    mask = torch.zeros(num_rows, dtype=torch.bool)
    for start, count in spans:
        mask[start : start + count] = True
    return mask
