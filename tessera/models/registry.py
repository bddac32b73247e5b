"""ModelRegistry: config.json `architectures` -> model class, built-in or registered out of tree."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Union

logger = logging.getLogger(__name__)

# Built-in architectures, imported on first use so that importing tessera stays cheap.
_BUILTIN_MODELS = {
    "LlavaForConditionalGeneration": "tessera.models.llava:LlavaForConditionalGeneration",
    "FuyuForCausalLM": "tessera.models.fuyu:FuyuForCausalLM",
    "LlamaForCausalLM": "tessera.models.llama:LlamaForCausalLM",
    "PersimmonForCausalLM": "tessera.models.persimmon:PersimmonForCausalLM",
}


class _ModelRegistry:
    def __init__(self) -> None:
        self._models: dict[str, Union[type, str]] = dict(_BUILTIN_MODELS)

    def register_model(self, architecture: str, model_cls: Union[type, str]) -> None:
        """Register `model_cls` (a class, or "module.path:ClassName" imported lazily) for an
        architecture name as written in config.json, as vLLM plugins do."""
        if not isinstance(model_cls, (type, str)) or (isinstance(model_cls, str) and ":" not in model_cls):
            raise ValueError(f"model_cls must be a class or a 'module.path:ClassName' string, got {model_cls!r}")
        if architecture in self._models:
            logger.warning("Architecture %s is already registered; replacing it with %s.", architecture, model_cls)
        self._models[architecture] = model_cls

    def get_supported_archs(self) -> list[str]:
        return sorted(self._models)

    def load_model_cls(self, architecture: str) -> type:
        entry = self._models[architecture]
        if isinstance(entry, str):
            module_name, class_name = entry.split(":")
            entry = getattr(importlib.import_module(module_name), class_name)
            self._models[architecture] = entry
        return entry

    def resolve_model_cls(self, architectures: Sequence[str]) -> tuple[type, str]:
        """The first supported architecture of a config's `architectures` list."""
        for arch in architectures:
            if arch in self._models:
                return self.load_model_cls(arch), arch
        raise ValueError(
            f"Model architectures {list(architectures)} are not supported. Supported: "
            f"{', '.join(self.get_supported_archs())}. Register another with "
            "tessera.ModelRegistry.register_model(architecture, model_cls)."
        )


ModelRegistry = _ModelRegistry()
