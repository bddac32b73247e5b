"""Multimodal processing, with the names and import paths of vLLM's `vllm.multimodal`."""

from .inputs import (
    MultiModalDataDict,
    MultiModalFieldConfig,
    MultiModalInputs,
    MultiModalKwargs,
    MultiModalKwargsItem,
    NestedTensors,
    PlaceholderRange,
)
from .registry import MultiModalRegistry

MULTIMODAL_REGISTRY = MultiModalRegistry()
"""The global registry: model classes register their processors here."""

__all__ = [
    "MULTIMODAL_REGISTRY",
    "MultiModalDataDict",
    "MultiModalFieldConfig",
    "MultiModalInputs",
    "MultiModalKwargs",
    "MultiModalKwargsItem",
    "MultiModalRegistry",
    "NestedTensors",
    "PlaceholderRange",
]
