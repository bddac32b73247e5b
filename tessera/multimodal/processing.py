"""The multimodal processor: prompt + items -> token ids, placeholders and model kwargs.

A model author subclasses `BaseProcessingInfo` and `BaseMultiModalProcessor` as vLLM's
multimodal guide describes; everything else (parsing, limits, the processor-output cache,
token prompts, prompt updates, placeholders, hashes) happens here, model-agnostically.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Generic, Optional, TypeVar

from transformers import BatchFeature

from .cache import ProcessingCache
from .context import InputProcessingContext  # noqa: F401  (re-exported)
from .hasher import MultiModalHasher
from .hf_compat import tokenize_text_only
from .inputs import MultiModalDataDict, MultiModalFieldConfig, MultiModalInputs, MultiModalKwargs, MultiModalUUIDDict
from .parse import EmbeddingItems, MultiModalDataItems, MultiModalDataParser
from .placeholders import place_items
from .processing_info import DEFAULT_MM_LIMIT, BaseProcessingInfo  # noqa: F401  (re-exported, as vLLM has them here)
from .processor_options import check_mm_kwargs, check_request_magnitudes
from .profiling import BaseDummyInputsBuilder
from .prompt_matching import ResolvedUpdates, resolve_updates
from .prompt_updates import (  # noqa: F401  (re-exported: model files import them from here)
    PromptIndex,
    PromptIndexTargets,
    PromptInsertion,
    PromptReplacement,
    PromptSeq,
    PromptUpdate,
    PromptUpdateDetails,
    TokenCodec,
    UpdateMode,
)

_I = TypeVar("_I", bound=BaseProcessingInfo)


class BaseMultiModalProcessor(ABC, Generic[_I]):
    def __init__(
        self, info: _I, dummy_inputs: "BaseDummyInputsBuilder[_I]", *, cache: Optional[ProcessingCache] = None
    ) -> None:
        self.info = info
        self.dummy_inputs = dummy_inputs
        self.cache = cache
        self.data_parser = self._get_data_parser()
        self._codec = TokenCodec(info.get_tokenizer())

    def __call__(
        self, prompt: PromptSeq, mm_data: MultiModalDataDict, hf_processor_mm_kwargs: Mapping[str, object] = {}
    ):
        return self.apply(prompt, mm_data, hf_processor_mm_kwargs)

    # ---- what model authors override --------------------------------------------------------

    def _get_data_parser(self) -> MultiModalDataParser:
        return MultiModalDataParser()

    @abstractmethod
    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        """How each HF output tensor splits into items."""

    @abstractmethod
    def _get_prompt_updates(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        out_mm_kwargs: MultiModalKwargs,
    ) -> Sequence[PromptUpdate]:
        """The prompt updates that the HF processor performs, one application per item."""

    def _call_hf_processor(
        self, prompt: str, mm_data: Mapping[str, object], mm_kwargs: Mapping[str, object]
    ) -> BatchFeature:
        """Call the HF processor; `mm_data` uses its keyword names (e.g. ``images``). Text alone
        goes to the processor's tokenizer: transformers 5 processors refuse a prompt whose
        placeholders (``<image>``) have no items, which is how text reaches them here (the
        processor-output cache and token prompts process items apart from the text)."""
        if not mm_data:
            hf_processor = self.info.get_hf_processor(**mm_kwargs)
            call_kwargs = self.info.ctx.get_call_kwargs(hf_processor, mm_kwargs)
            return tokenize_text_only(hf_processor, prompt, call_kwargs, self.info.get_tokenizer())
        return self.info.ctx.call_hf_processor(
            self.info.get_hf_processor(**mm_kwargs), dict(text=prompt, **mm_data), mm_kwargs
        )

    def _hf_processor_applies_updates(
        self, prompt_text: str, mm_items: MultiModalDataItems, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> bool:
        """Whether the HF processor may have applied the prompt updates (then we look for them)."""
        return True

    def _apply_hf_processor_tokens_only(self, prompt_tokens: list[int]) -> list[int]:
        """Apply to token ids what the HF processor does to text regardless of the items."""
        return prompt_tokens

    # ---- the processing steps, in order -----------------------------------------------------

    def apply(
        self,
        prompt: PromptSeq,
        mm_data: MultiModalDataDict,
        hf_processor_mm_kwargs: Mapping[str, object] = {},
        *,
        mm_uuids: Optional[MultiModalUUIDDict] = None,
    ) -> MultiModalInputs:
        """Process a text or token-id prompt with its multimodal data. `mm_uuids` names items
        (per modality, a list aligned with the items, None for "hash the content"; a string for a
        single item): a named item is cached under its name, so the caller promises that one name
        always means the same content."""
        self.check_mm_kwargs(hf_processor_mm_kwargs)
        mm_items = self._to_mm_items(mm_data, hf_processor_mm_kwargs)
        mm_hashes = self._hash_mm_items(mm_items, hf_processor_mm_kwargs, mm_uuids=mm_uuids)
        if self.cache is None:
            prompt_ids, mm_kwargs, maybe_applied = self._apply_hf_processor_main(
                prompt, mm_items, hf_processor_mm_kwargs, enable_hf_prompt_update=True
            )
        else:
            prompt_ids, mm_kwargs = self._cached_apply_hf_processor(prompt, mm_items, hf_processor_mm_kwargs, mm_hashes)
            maybe_applied = False
        updates = self._get_prompt_updates(mm_items, hf_processor_mm_kwargs, mm_kwargs)
        resolved = resolve_updates(updates, mm_items.get_all_counts(), self._codec)
        prompt_ids, placeholders = self._place_items(prompt_ids, resolved, maybe_applied)
        return MultiModalInputs(
            type="multimodal",
            prompt=self._codec.decode(prompt_ids),
            prompt_token_ids=prompt_ids,
            mm_kwargs=mm_kwargs,
            mm_hashes=mm_hashes,
            mm_placeholders=placeholders,
        )

    def check_mm_kwargs(self, hf_processor_mm_kwargs: Mapping[str, object] = {}) -> None:
        """Refuse (ValueError) mm_processor_kwargs, the model's merged with `hf_processor_mm_kwargs` (a
        request's), that no part of the model's processor takes, naming them and the options it does
        take; and a request's numbers that ask for images over 8192 pixels a side (processor_options.py)."""
        merged = self.info.ctx.get_merged_mm_kwargs(hf_processor_mm_kwargs)
        if merged:
            hf_processor = self.info.get_hf_processor()
            check_mm_kwargs(hf_processor, merged)
            check_request_magnitudes(hf_processor, hf_processor_mm_kwargs)

    def _to_mm_items(
        self, mm_data: MultiModalDataDict, hf_processor_mm_kwargs: Mapping[str, object] = {}
    ) -> MultiModalDataItems:
        """The items, parsed and checked against the limits (a model may combine items as its processing
        kwargs say: Qwen2.5-Omni's use_audio_in_video)."""
        mm_items = self.data_parser.parse_mm_data(mm_data)
        limits = self.info.get_allowed_mm_limits()
        for modality, items in mm_items.items():
            if modality not in limits:
                raise ValueError(
                    f"This model does not support {modality} inputs; it accepts: {', '.join(limits) or 'text only'}."
                )
            if items.get_count() > limits[modality]:
                raise ValueError(
                    f"At most {limits[modality]} {modality}(s) may be provided in one prompt. "
                    f"Got {items.get_count()}; {self._limit_hint(modality)}"
                )
        return mm_items

    def _limit_hint(self, modality: str) -> str:
        supported = self.info.get_supported_mm_limits().get(modality)
        user = self.info.ctx.model_config.multimodal_config.get_limit_per_prompt(modality)
        if user is not None and (supported is None or user < supported):
            return f"raise limit_mm_per_prompt={{'{modality}': N}} to allow more."
        return "this is the model's own limit; send fewer items."

    def _hash_mm_items(
        self,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        *,
        mm_uuids: Optional[MultiModalUUIDDict] = None,
    ) -> dict[str, list[str]]:
        """Each item's cache key: its id when the caller named it (and no processor kwargs could make
        the same item process differently; else the id hashed with them), else a content hash."""
        kwargs = {**self.info.ctx.model_config.multimodal_config.mm_processor_kwargs, **hf_processor_mm_kwargs}
        hashes = {}
        for modality, items in mm_items.items():
            uuids = _item_uuids(mm_uuids, modality, items.get_count())
            hashes[modality] = [
                uuid
                if uuid is not None and not kwargs
                else MultiModalHasher.hash_kwargs(
                    model_id=self.info.model_id,
                    modality=modality,
                    item=items.get_hash_item(i) if uuid is None else uuid,
                    kwargs=kwargs,
                )
                for i, uuid in enumerate(uuids)
            ]
        return hashes

    def _apply_hf_processor_text_mm(
        self, prompt_text: str, mm_items: MultiModalDataItems, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> tuple[list[int], MultiModalKwargs, bool]:
        """One HF call on text + items; returns token ids, kwargs and whether updates may be applied."""
        processor_data: dict[str, object] = {}
        passthrough_data: dict[str, object] = {}
        for items in mm_items.values():
            processor_data.update(items.get_processor_data())
            passthrough_data.update(items.get_passthrough_data())
        processed = dict(self._call_hf_processor(prompt_text, processor_data, hf_processor_mm_kwargs))
        processed.update(passthrough_data)
        (prompt_ids,) = processed.pop("input_ids").tolist()
        fields = self._get_mm_fields_config(BatchFeature(processed), hf_processor_mm_kwargs)
        mm_kwargs = self._kwargs_from_hf_inputs(processed, fields, mm_items)
        return prompt_ids, mm_kwargs, self._hf_processor_applies_updates(prompt_text, mm_items, hf_processor_mm_kwargs)

    def _kwargs_from_hf_inputs(self, processed, fields, mm_items: MultiModalDataItems) -> MultiModalKwargs:
        for modality, items in mm_items.items():
            if isinstance(items, EmbeddingItems) and f"{modality}_embeds" not in fields:
                raise ValueError(f"This model does not accept precomputed {modality}_embeds; pass raw {modality}s.")
        mm_kwargs = MultiModalKwargs.from_hf_inputs(processed, fields)
        for modality, count in mm_items.get_all_counts().items():
            if mm_kwargs.get_item_count(modality) != count:
                raise RuntimeError(
                    f"The HF processor returned {mm_kwargs.get_item_count(modality)} {modality} item(s) for "
                    f"{count} input(s); check _get_mm_fields_config / _call_hf_processor of this model."
                )
        return mm_kwargs

    def _apply_hf_processor_text_only(self, prompt_text: str) -> list[int]:
        prompt_ids, _, _ = self._apply_hf_processor_text_mm(prompt_text, MultiModalDataItems(), {})
        return prompt_ids

    def _apply_hf_processor_mm_only(
        self, mm_items: MultiModalDataItems, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> MultiModalKwargs:
        """Process items without the prompt: the HF processor sees dummy text with one placeholder
        per item, so it neither complains about a mismatch nor needs the real prompt."""
        if not mm_items:
            return MultiModalKwargs({})
        if not any(items.get_processor_data() for items in mm_items.values()):  # only precomputed embeddings
            passthrough: dict[str, object] = {}
            for items in mm_items.values():
                passthrough.update(items.get_passthrough_data())
            fields = self._get_mm_fields_config(BatchFeature(passthrough), hf_processor_mm_kwargs)
            return self._kwargs_from_hf_inputs(passthrough, fields, mm_items)
        dummy_text = self.dummy_inputs.get_dummy_text(mm_items.get_all_counts())
        _, mm_kwargs, _ = self._apply_hf_processor_text_mm(dummy_text, mm_items, hf_processor_mm_kwargs)
        return mm_kwargs

    def _apply_hf_processor_main(
        self,
        prompt: PromptSeq,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        *,
        enable_hf_prompt_update: bool,
    ) -> tuple[list[int], MultiModalKwargs, bool]:
        if isinstance(prompt, str):
            if enable_hf_prompt_update:
                try:
                    return self._apply_hf_processor_text_mm(prompt, mm_items, hf_processor_mm_kwargs)
                except ValueError as hf_error:
                    if not mm_items:
                        raise
                    # transformers 5 processors refuse a prompt whose placeholders do not match
                    # the items; processed apart, the placement below names what is wrong.
                    try:
                        return self._apply_hf_processor_main(
                            prompt, mm_items, hf_processor_mm_kwargs, enable_hf_prompt_update=False
                        )
                    except ValueError:
                        raise hf_error from None
            prompt_ids = self._apply_hf_processor_text_only(prompt)
        else:
            prompt_ids = self._apply_hf_processor_tokens_only(list(prompt))
        return prompt_ids, self._apply_hf_processor_mm_only(mm_items, hf_processor_mm_kwargs), False

    def _cached_apply_hf_processor(
        self,
        prompt: PromptSeq,
        mm_items: MultiModalDataItems,
        hf_processor_mm_kwargs: Mapping[str, object],
        mm_hashes: Mapping[str, list[str]],
    ) -> tuple[list[int], MultiModalKwargs]:
        """Send only uncached items to the HF processor (in one call), then merge in prompt order."""
        assert self.cache is not None
        cached: dict[str, dict[int, Any]] = {}
        missing = MultiModalDataItems()
        for modality, items in mm_items.items():
            if isinstance(items, EmbeddingItems):  # precomputed: never cached
                missing[modality] = items
                continue
            cached[modality] = {}
            for i, key in enumerate(mm_hashes[modality]):
                hit = self.cache.get(key)
                if hit is not None:
                    cached[modality][i] = hit
            missing_indices = [i for i in range(items.get_count()) if i not in cached[modality]]
            if missing_indices:
                missing[modality] = items.subset(missing_indices)

        prompt_ids, fresh, _ = self._apply_hf_processor_main(
            prompt, missing, hf_processor_mm_kwargs, enable_hf_prompt_update=False
        )
        merged = []
        for modality, items in mm_items.items():
            fresh_items = iter(fresh.get_items(modality))
            for i in range(items.get_count()):
                item = cached.get(modality, {}).get(i)
                if item is None:
                    item = next(fresh_items)
                    if not isinstance(items, EmbeddingItems):
                        self.cache.put(mm_hashes[modality][i], item)
                merged.append(item)
        return prompt_ids, MultiModalKwargs.from_items(merged)

    def _place_items(
        self, prompt_ids: list[int], resolved: ResolvedUpdates, maybe_applied: bool
    ) -> tuple[list[int], dict]:
        """Find the placeholders the HF processor expanded, or expand them ourselves (placeholders.py)."""
        return place_items(prompt_ids, resolved, self._codec, maybe_applied=maybe_applied)


# Names model files import from this module, as in vLLM.
__all__ = [
    "BaseMultiModalProcessor",
    "BaseProcessingInfo",
    "InputProcessingContext",
    "PromptIndex",
    "PromptIndexTargets",
    "PromptInsertion",
    "PromptReplacement",
    "PromptUpdate",
    "PromptUpdateDetails",
    "PromptSeq",
    "UpdateMode",
]


def _item_uuids(mm_uuids: Optional[MultiModalUUIDDict], modality: str, count: int) -> list[Optional[str]]:
    """The caller's id of each of `count` items of `modality` (None where not named)."""
    given = (mm_uuids or {}).get(modality)
    if given is None:
        return [None] * count
    uuids = [given] if isinstance(given, str) else list(given)
    if len(uuids) != count or not all(u is None or isinstance(u, str) for u in uuids):
        raise ValueError(
            f"multi_modal_uuids[{modality!r}] must list one id (a string, or None) per {modality}: "
            f"{count} {modality}(s) were given, {len(uuids)} id(s)."
        )
    return uuids
