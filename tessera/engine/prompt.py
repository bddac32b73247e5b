"""Turning a user prompt into what a request needs: token ids and placeholder-located items."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

from .request import MultiModalItem

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int], Mapping[str, Any]]
"""A string, token ids, or a dict with "prompt" or "prompt_token_ids", and optionally
"multi_modal_data" and "mm_processor_kwargs"."""


@dataclass
class PromptInputs:
    prompt: Optional[str]
    token_ids: list[int]
    mm_items: list[MultiModalItem]


def process_prompt(engine: "LLMEngine", prompt: PromptType, truncate_to: Optional[int] = None) -> PromptInputs:
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    elif isinstance(prompt, list):
        prompt = {"prompt_token_ids": prompt}
    if not isinstance(prompt, Mapping):
        raise ValueError(f"A prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
    text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if (text is None) == (token_ids is None):
        raise ValueError('A prompt dict needs exactly one of "prompt" and "prompt_token_ids"')
    mm_data = prompt.get("multi_modal_data") or {}
    if engine.processor is None:
        if mm_data:
            raise ValueError(f"{engine.model_config.architectures[0]} is a text-only model; remove multi_modal_data.")
        ids = engine.tokenizer.encode(text) if token_ids is None else list(token_ids)
        return _truncated(PromptInputs(text, ids, []), truncate_to)
    processed = engine.processor.apply(
        text if token_ids is None else list(token_ids), mm_data, prompt.get("mm_processor_kwargs") or {}
    )
    items = [
        MultiModalItem(modality, processed["mm_hashes"][modality][i], processed["mm_kwargs"].get_item(modality, i), p)
        for modality, placeholders in processed["mm_placeholders"].items()
        for i, p in enumerate(placeholders)
    ]
    return _truncated(PromptInputs(text, processed["prompt_token_ids"], items), truncate_to)


def _truncated(inputs: PromptInputs, keep: Optional[int]) -> PromptInputs:
    """Keep the last `keep` tokens; an item cut by the boundary is dropped whole, with its tokens."""
    if keep is None or len(inputs.token_ids) <= keep:
        return inputs
    start = len(inputs.token_ids) - keep
    for item in inputs.mm_items:
        if item.start < start < item.end:
            start = item.end  # never start inside an item's placeholders
    kept = [item for item in inputs.mm_items if item.start >= start]
    dropped = len(inputs.mm_items) - len(kept)
    if dropped:
        logger.warning("truncate_prompt_tokens=%d dropped %d image(s) that did not fit whole", keep, dropped)
    shifted = []
    for item in kept:
        placeholder = type(item.placeholder)(
            item.placeholder.offset - start, item.placeholder.length, item.placeholder.is_embed
        )
        shifted.append(MultiModalItem(item.modality, item.hash, item.kwargs, placeholder))
    return PromptInputs(inputs.prompt, inputs.token_ids[start:], shifted)
