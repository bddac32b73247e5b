"""One sequence being generated: its tokens, its images, where it stands, how it finished."""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...multimodal.inputs import MultiModalKwargsItem, PlaceholderRange
from ...outputs import RequestMetrics
from ...sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed while running it (a bug or a fault, not bad input)

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass
class MultiModalItem:
    """One image (or other item) of a prompt: its processor outputs and where it sits."""

    modality: str
    hash: str
    kwargs: MultiModalKwargsItem
    placeholder: PlaceholderRange
    lora_int_id: int = 0
    """The LoRA adapter its encoder run takes (one that adapts the vision tower or projector; its hash says so)."""

    @property
    def start(self) -> int:
        return self.placeholder.offset

    @property
    def end(self) -> int:
        return self.placeholder.offset + self.placeholder.length

    @property
    def num_embeds(self) -> int:
        return self.placeholder.get_num_embeds()

    # vLLM's MultiModalFeatureSpec names, which model files (get_mrope_input_positions) read
    @property
    def data(self) -> MultiModalKwargsItem:
        return self.kwargs

    @property
    def identifier(self) -> str:
        return self.hash

    @property
    def mm_position(self) -> PlaceholderRange:
        return self.placeholder

    def embed_spans(self) -> list[tuple[int, int]]:
        """[start, end) prompt positions of the runs of tokens that take this item's embeddings."""
        is_embed = self.placeholder.is_embed
        if is_embed is None:
            return [(self.start, self.end)]
        spans, run_start = [], None
        for i, flag in enumerate([*is_embed.tolist(), False]):
            if flag and run_start is None:
                run_start = i
            elif not flag and run_start is not None:
                spans.append((self.start + run_start, self.start + i))
                run_start = None
        return spans

    def embed_rows(self, start: int, end: int) -> tuple[torch.Tensor, slice]:
        """For prompt positions [start, end) overlapping this item: the mask of positions that take
        an embedding, and the slice of the item's embedding rows that they take."""
        lo, hi = max(start, self.start) - self.start, min(end, self.end) - self.start
        is_embed = self.placeholder.is_embed
        if is_embed is None:
            return torch.ones(hi - lo, dtype=torch.bool), slice(lo, hi)
        first = int(is_embed[:lo].sum())
        return is_embed[lo:hi], slice(first, first + int(is_embed[lo:hi].sum()))


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        mm_items: list[MultiModalItem] = (),  # type: ignore[assignment]
        prompt: Optional[str] = None,
        arrival_time: Optional[float] = None,
        parent_id: Optional[str] = None,
        index: int = 0,
        prompt_embeds: Optional[torch.Tensor] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_embeds = prompt_embeds  # [P, hidden]: the prompt's rows instead of its tokens' embeddings
        # what its cached blocks are keyed by instead of its placeholder ids
        self.embeds_hash = hashlib.sha256(prompt_embeds.float().numpy().tobytes()).hexdigest() \
            if prompt_embeds is not None else None
        self.parent_id = parent_id or request_id
        self.index = index  # which of the parent's n outputs this is
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.mm_items = sorted(mm_items, key=lambda item: item.start)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, float]] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[object] = None
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        self.generator: Optional[torch.Generator] = None
        # structured outputs: this sequence's grammar matcher (a StructuredOutputRequest), set when
        # the engine adds the request; it masks the sampled tokens and ends the output when complete
        self.structured_output: Optional[Any] = None
        self.hidden_parts: list[torch.Tensor] = []  # a pooling request's final hidden states, chunk by chunk
        if sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(sampling_params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def items_overlapping(self, start: int, end: int) -> list[MultiModalItem]:
        return [item for item in self.mm_items if item.start < end and item.end > start]

    def __repr__(self) -> str:
        return f"Request({self.request_id}, {self.status.value}, {self.num_computed_tokens}/{self.num_tokens})"


def processed_items(processed: Mapping[str, Any]) -> list[MultiModalItem]:
    """A processor's output (`MultiModalInputs`) as items: modality, hash, kwargs and placeholder each."""
    return [
        MultiModalItem(modality, processed["mm_hashes"][modality][i], processed["mm_kwargs"].get_item(modality, i), p)
        for modality, placeholders in processed["mm_placeholders"].items()
        for i, p in enumerate(placeholders)
    ]
