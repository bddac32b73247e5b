"""Dummy inputs: for HF calls without the real prompt, and for worst-case memory profiling."""

from __future__ import annotations

from abc import ABC
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from PIL import Image

from .inputs import MultiModalDataDict
from .processing_info import BaseProcessingInfo

_I = TypeVar("_I", bound=BaseProcessingInfo)


@dataclass
class ProcessorInputs:
    """Inputs for one HF processor call."""

    prompt_text: str
    mm_data: MultiModalDataDict
    hf_processor_mm_kwargs: Mapping[str, object] = field(default_factory=dict)


class BaseDummyInputsBuilder(ABC, Generic[_I]):
    """Builds dummy inputs. Override `get_dummy_processor_inputs` (as in the guide), or
    `get_dummy_text` and `get_dummy_mm_data`."""

    def __init__(self, info: _I) -> None:
        self.info = info
        self._dummy_text: dict[tuple, str] = {}

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        """Text with one input placeholder per item, as the HF processor expects."""
        if type(self).get_dummy_processor_inputs is BaseDummyInputsBuilder.get_dummy_processor_inputs:
            raise NotImplementedError(
                f"{type(self).__name__} must override get_dummy_processor_inputs, "
                "or get_dummy_text and get_dummy_mm_data."
            )
        key = tuple(sorted(mm_counts.items()))
        if key not in self._dummy_text:  # computed once per item counts: it may build dummy images
            self._dummy_text[key] = self.get_dummy_processor_inputs(0, mm_counts).prompt_text
        return self._dummy_text[key]

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int]) -> MultiModalDataDict:
        """Items that give the most placeholder tokens."""
        raise NotImplementedError(f"{type(self).__name__} must override get_dummy_mm_data")

    def get_dummy_processor_inputs(self, seq_len: int, mm_counts: Mapping[str, int]) -> ProcessorInputs:
        """Worst-case inputs: the items that give the most placeholder tokens."""
        return ProcessorInputs(
            prompt_text=self.get_dummy_text(mm_counts), mm_data=self.get_dummy_mm_data(seq_len, mm_counts)
        )

    def _get_dummy_images(self, *, width: int, height: int, num_images: int) -> list[Image.Image]:
        if num_images == 0:
            return []
        image = Image.new("RGB", (width, height), color=0)
        return [image] * num_images


class ProfiledProcessor(Protocol[_I]):
    """What the profiler uses of a `BaseMultiModalProcessor`."""

    info: _I
    dummy_inputs: BaseDummyInputsBuilder[_I]

    def apply(self, prompt: Any, mm_data: Any, hf_processor_mm_kwargs: Any) -> Any: ...


class MultiModalProfiler(Generic[_I]):
    """Measures what the worst-case items cost, by processing the dummy inputs."""

    def __init__(self, processor: ProfiledProcessor[_I]) -> None:
        self.processor = processor

    def get_mm_max_tokens_per_item(self, seq_len: int) -> Mapping[str, int]:
        """Placeholder tokens of the largest item of each supported modality."""
        info = self.processor.info
        mm_counts = {modality: 1 for modality in info.get_supported_mm_limits()}
        known = info.get_mm_max_tokens_per_item(seq_len, mm_counts)
        if known is not None:
            return known
        inputs = self.processor.dummy_inputs.get_dummy_processor_inputs(seq_len, mm_counts)
        processed = self.processor.apply(inputs.prompt_text, inputs.mm_data, inputs.hf_processor_mm_kwargs)
        return {
            modality: max(p.length for p in placeholders)
            for modality, placeholders in processed["mm_placeholders"].items()
        }
