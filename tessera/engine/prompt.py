"""Turning a user prompt into what a request needs: token ids and placeholder-located items."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Union

import torch

from ..errors import InputError, InputTooLargeError
from .core.request import MultiModalItem, processed_items

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int], Mapping[str, Any]]
"""A string, token ids, or a dict with "prompt" or "prompt_token_ids", and optionally
"multi_modal_data", "mm_processor_kwargs" (this prompt's HF processor kwargs, over the configured
ones) and "multi_modal_uuids" (ids naming the items, vLLM's shape: per modality a list aligned with
the items, None for "hash the content", or a string when there is one item)."""


@dataclass
class PromptInputs:
    prompt: Optional[str]
    token_ids: list[int]
    mm_items: list[MultiModalItem]
    prompt_embeds: Optional[Any] = None
    """A prompt given as embeddings [T, hidden] (`{"prompt_embeds": tensor}`): its rows replace the token embeddings
    of `token_ids` (T placeholder ids, 0), as HF's `inputs_embeds`."""


class PromptContext(Protocol):
    """What turning a prompt into inputs reads (the InputPreprocessor has it)."""

    model_config: Any
    tokenizer: Any
    processor: Any  # the model's multimodal processor, or None for a text model
    vocab_size: int
    max_prompt_chars: int


def process_prompt(engine: PromptContext, prompt: PromptType, truncate_to: Optional[int] = None) -> PromptInputs:
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    elif isinstance(prompt, list):
        prompt = {"prompt_token_ids": prompt}
    if not isinstance(prompt, Mapping):
        raise InputError(f"A prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
    if prompt.get("prompt_embeds") is not None:
        return _embeds_prompt(engine, prompt)
    text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if (text is None) == (token_ids is None):
        raise InputError('A prompt dict needs exactly one of "prompt" and "prompt_token_ids"')
    if text is not None:
        _check_text(text, None if truncate_to is not None else engine.max_prompt_chars)
    else:
        token_ids = _checked_token_ids(token_ids, engine.vocab_size)
    mm_data = prompt.get("multi_modal_data") or {}
    if engine.processor is None:
        if mm_data:
            raise InputError(f"{engine.model_config.architectures[0]} is a text-only model; remove multi_modal_data.")
        _checked_mm_processor_kwargs(prompt.get("mm_processor_kwargs"))  # nothing to apply them to, but well-formed
        _checked_mm_uuids(prompt.get("multi_modal_uuids"), None, {})
        ids = engine.tokenizer.encode(text) if token_ids is None else token_ids
        return _truncated(PromptInputs(text, ids, []), truncate_to)
    mm_kwargs = _checked_mm_processor_kwargs(prompt.get("mm_processor_kwargs"))
    mm_uuids = _checked_mm_uuids(prompt.get("multi_modal_uuids"), engine.processor.data_parser, mm_data)
    processed = engine.processor.apply(text if token_ids is None else token_ids, mm_data, mm_kwargs, mm_uuids=mm_uuids)
    return _truncated(PromptInputs(text, processed["prompt_token_ids"], processed_items(processed)), truncate_to)


def _embeds_prompt(engine: PromptContext, prompt: Mapping[str, Any]) -> PromptInputs:
    """`{"prompt_embeds": [T, hidden] float tensor}` (nothing else: no text, ids or items) as inputs."""
    extra = sorted(key for key, value in prompt.items() if key != "prompt_embeds" and value)
    if extra:
        raise InputError(f"A prompt_embeds prompt takes nothing else; remove {', '.join(extra)}.")
    if getattr(engine.model_config.hf_config.get_text_config(), "hidden_size_per_layer_input", 0):
        raise InputError("This model looks up per-layer embeddings by token id (Gemma 4): it takes no prompt_embeds.")
    embeds = prompt["prompt_embeds"]
    hidden = engine.model_config.hf_config.get_text_config().hidden_size
    if not isinstance(embeds, torch.Tensor) or embeds.ndim != 2 or not embeds.is_floating_point():
        raise InputError(f"prompt_embeds must be a float tensor [tokens, {hidden}].")
    if embeds.shape[1] != hidden or embeds.shape[0] == 0:
        raise InputError(f"prompt_embeds has shape {tuple(embeds.shape)}; this model takes [tokens, {hidden}].")
    if not torch.isfinite(embeds).all():
        raise InputError("prompt_embeds holds NaN or infinite values.")
    return PromptInputs(None, [0] * embeds.shape[0], [], embeds.detach().cpu())


def _checked_mm_processor_kwargs(kwargs: Any) -> Mapping[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise InputError(f'"mm_processor_kwargs" must be a dict of keyword names to values, got {_kind(kwargs)}.')
    return kwargs


def _checked_mm_uuids(uuids: Any, parser: Any, mm_data: Mapping[str, Any]) -> Optional[dict[str, list[Optional[str]]]]:
    """`multi_modal_uuids` as {modality: [id or None per item]}, or an InputError saying what does
    not match the items of `mm_data` (keys are modalities: "image" also for "image_embeds")."""
    if uuids is None:
        return None
    if not isinstance(uuids, Mapping):
        raise InputError(
            '"multi_modal_uuids" must be a dict of modality to a list of ids (a string, or null to hash the '
            f"item) aligned with the items, got {_kind(uuids)}."
        )
    if not uuids:
        return None
    parsed = parser.parse_mm_data(mm_data) if mm_data else {}
    counts = {modality: items.get_count() for modality, items in parsed.items()}
    checked: dict[str, list[Optional[str]]] = {}
    for modality, ids in uuids.items():
        if modality not in counts:
            given = ", ".join(repr(m) for m in counts) or "none"
            raise InputError(
                f"multi_modal_uuids names the modality {_short(modality)}, which has no items in multi_modal_data "
                f"(modalities given: {given})."
            )
        ids = [ids] if isinstance(ids, str) else ids
        if not isinstance(ids, (list, tuple)):
            raise InputError(
                f"multi_modal_uuids[{modality!r}] must be a list of ids (strings or null), or one string for "
                f"one item; got {_kind(ids)}."
            )
        for i, item_id in enumerate(ids):
            if item_id is not None and not isinstance(item_id, str):
                raise InputError(
                    f"multi_modal_uuids[{modality!r}][{i}] must be a string or null, got {_kind(item_id)}."
                )
        if len(ids) != counts[modality]:
            raise InputError(
                f"multi_modal_uuids[{modality!r}] has {len(ids)} id(s) for {counts[modality]} {modality} item(s); "
                "give one per item, in order (null for an item to be hashed)."
            )
        checked[modality] = list(ids)
    return checked


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a dict"
    return {list: "a list", tuple: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, numbers.Number) else type(value).__name__
    )


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of this vocabulary stands for (its longest vocabulary string:
    byte-level and byte-fallback spellings are never shorter than the text they cover)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def _check_text(text: Any, max_chars: Optional[int]) -> None:
    if not isinstance(text, str):
        raise InputError(f'"prompt" must be a string, got {type(text).__name__}')
    if max_chars is not None:
        check_text_length(len(text), max_chars)


def check_text_length(num_chars: int, max_chars: int) -> None:
    """InputTooLargeError if a prompt of `num_chars` characters cannot fit the context."""
    if num_chars > max_chars:
        raise InputTooLargeError(
            f"The prompt has {num_chars} characters, more than the model's context can hold "
            f"(at most {max_chars}); shorten it."
        )


def _checked_token_ids(token_ids: Any, vocab_size: int) -> list[int]:
    """The ids as a list of ints, each a row of the vocabulary, or an InputError naming the first bad one."""
    if not isinstance(token_ids, (list, tuple)):
        raise InputError(f'"prompt_token_ids" must be a list of integers, got {type(token_ids).__name__}')
    for position, token in enumerate(token_ids):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise InputError(f"Token id at position {position} is {token!r}, not an integer.")
        if not 0 <= token < vocab_size:
            raise InputError(
                f"Token id {token} at position {position} is outside the vocabulary (0 to {vocab_size - 1})."
            )
    return [int(token) for token in token_ids]


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
