"""MULTIMODAL_REGISTRY: which processing classes belong to which model class."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

from ..config import ModelConfig, MultiModalConfig
from .cache import ProcessingCache
from .context import InputProcessingContext
from .processing import BaseMultiModalProcessor, BaseProcessingInfo
from .profiling import BaseDummyInputsBuilder, MultiModalProfiler

logger = logging.getLogger(__name__)
_T = TypeVar("_T", bound=type)


@dataclass(frozen=True)
class ProcessorFactories:
    info: Callable[[InputProcessingContext], BaseProcessingInfo]
    processor: Callable[..., BaseMultiModalProcessor]
    dummy_inputs: Callable[[BaseProcessingInfo], BaseDummyInputsBuilder]

    def build_processor(self, ctx: InputProcessingContext, *, cache: Optional[ProcessingCache]):
        info = self.info(ctx)
        return self.processor(info, self.dummy_inputs(info), cache=cache)


class MultiModalRegistry:
    def __init__(self) -> None:
        self._processor_factories: dict[type, ProcessorFactories] = {}
        self._resolve_model_cls: Optional[Callable[[list[str]], tuple[type, str]]] = None

    def register_processor(
        self,
        processor: Callable[..., BaseMultiModalProcessor],
        *,
        info: Callable[[InputProcessingContext], BaseProcessingInfo],
        dummy_inputs: Callable[[BaseProcessingInfo], BaseDummyInputsBuilder],
    ) -> Callable[[_T], _T]:
        """Class decorator: the decorated model class is processed by these classes."""

        def wrapper(model_cls: _T) -> _T:
            if model_cls in self._processor_factories:
                logger.warning("%s already has a multimodal processor; replacing it.", model_cls.__name__)
            self._processor_factories[model_cls] = ProcessorFactories(info, processor, dummy_inputs)
            return model_cls

        return wrapper

    def get_factories(self, model_cls: type) -> Optional[ProcessorFactories]:
        for cls in model_cls.__mro__:  # a subclass inherits its parent's processor
            if cls in self._processor_factories:
                return self._processor_factories[cls]
        return None

    def set_model_resolver(self, resolve: Callable[[list[str]], tuple[type, str]]) -> None:
        """How config.json's architectures become a model class: `tessera.models` installs
        `ModelRegistry.resolve_model_cls` when it is imported (models sit above this package,
        so the call goes that way round)."""
        self._resolve_model_cls = resolve

    def _model_cls(self, model_config: ModelConfig) -> tuple[type, str]:
        if self._resolve_model_cls is None:
            raise RuntimeError("No model registry is installed; import tessera (or tessera.models) first.")
        return self._resolve_model_cls(model_config.architectures)

    def supports_multimodal_inputs(self, model_config: ModelConfig) -> bool:
        model_cls, _ = self._model_cls(model_config)
        return self.get_factories(model_cls) is not None

    def create_processor(
        self,
        model: Union[str, Path, ModelConfig],
        *,
        tokenizer: Any = None,
        limit_mm_per_prompt: Optional[Mapping[str, int]] = None,
        mm_processor_kwargs: Optional[Mapping[str, Any]] = None,
        mm_processor_cache_gb: float = 1.0,
        trust_remote_code: bool = False,
    ) -> BaseMultiModalProcessor:
        """The processor of the model in folder `model` (its config.json names the architecture)."""
        if isinstance(model, ModelConfig):
            model_config = model
        else:
            mm_config = MultiModalConfig(
                limit_per_prompt=dict(limit_mm_per_prompt or {}),
                mm_processor_kwargs=dict(mm_processor_kwargs or {}),
                mm_processor_cache_gb=mm_processor_cache_gb,
            )
            model_config = ModelConfig(str(model), trust_remote_code=trust_remote_code, multimodal_config=mm_config)
        model_cls, arch = self._model_cls(model_config)
        factories = self.get_factories(model_cls)
        if factories is None:
            raise ValueError(
                f"{arch} ({model_cls.__name__}) has no multimodal processor; decorate the model class with "
                "@MULTIMODAL_REGISTRY.register_processor(...)."
            )
        ctx = InputProcessingContext(model_config, tokenizer)
        cache = ProcessingCache.from_gb(model_config.multimodal_config.mm_processor_cache_gb)
        return factories.build_processor(ctx, cache=cache)

    def get_max_tokens_per_item_by_modality(
        self, processor: BaseMultiModalProcessor, seq_len: int
    ) -> Mapping[str, int]:
        return MultiModalProfiler(processor).get_mm_max_tokens_per_item(seq_len)
