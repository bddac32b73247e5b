"""Helpers shared by processing and the engine (vLLM's `vllm/multimodal/utils.py` names)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import groupby
from typing import TypeVar

from .inputs import PlaceholderRange

_T = TypeVar("_T")


def argsort_mm_positions(mm_positions: Mapping[str, Sequence[PlaceholderRange]]) -> list[tuple[str, int]]:
    """(modality, index within the modality) of every item, in the order the items appear in the
    prompt, across modalities: a prompt with an image, a video, then another image gives
    [("image", 0), ("video", 0), ("image", 1)]."""
    flat = [(modality, index, p.offset) for modality, ranges in mm_positions.items() for index, p in enumerate(ranges)]
    return [(modality, index) for modality, index, _ in sorted(flat, key=lambda entry: entry[2])]


def group_by_modality(items: Iterable[_T], modality_of: Callable[[_T], str]) -> list[tuple[str, list[_T]]]:
    """Consecutive runs of items of one modality, in order: the encoder runs once per run, so a
    model sees its items in prompt order across modalities (vLLM's group_mm_kwargs_by_modality)."""
    return [(modality, list(run)) for modality, run in groupby(items, key=modality_of)]
