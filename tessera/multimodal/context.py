"""Access to the model's HF config, tokenizer and processor for the processing classes."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from transformers import AutoProcessor, AutoTokenizer, BatchFeature, PretrainedConfig, ProcessorMixin

from ..config import ModelConfig

_C = TypeVar("_C", bound=PretrainedConfig)
_P = TypeVar("_P", bound=ProcessorMixin)


class InputProcessingContext:
    def __init__(self, model_config: ModelConfig, tokenizer: Any = None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_config)
        self._processors: dict[tuple, ProcessorMixin] = {}

    def get_hf_config(self, typ: type[_C] = PretrainedConfig) -> _C:  # type: ignore[assignment]
        hf_config = self.model_config.hf_config
        if not isinstance(hf_config, typ):
            raise TypeError(f"Expected the model config to be a {typ.__name__}, found {type(hf_config).__name__}")
        return hf_config

    def get_hf_processor(self, typ: type[_P] = ProcessorMixin, /, **kwargs: object) -> _P:  # type: ignore[assignment]
        """The model folder's HF processor (loaded once per distinct kwargs), sharing our tokenizer."""
        key = (typ, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in self._processors:
            with _quiet_logger("transformers.models.auto.image_processing_auto"):  # "slow processor" notice
                processor = AutoProcessor.from_pretrained(
                    self.model_config.model,
                    tokenizer=self.tokenizer,
                    trust_remote_code=self.model_config.trust_remote_code,
                    **kwargs,
                )
            if not isinstance(processor, typ):
                raise TypeError(
                    f"Expected a {typ.__name__} in {self.model_config.model}, found {type(processor).__name__}"
                )
            self._processors[key] = processor
        return self._processors[key]  # type: ignore[return-value]

    def call_hf_processor(
        self, hf_processor: ProcessorMixin, data: Mapping[str, object], kwargs: Mapping[str, object] = {}
    ) -> BatchFeature:
        """Call the HF processor with the configured default kwargs, returning torch tensors."""
        merged = {**self.model_config.multimodal_config.mm_processor_kwargs, **kwargs}
        try:
            return hf_processor(**data, **merged, return_tensors="pt")
        except Exception as e:
            raise ValueError(
                f"{type(hf_processor).__name__} could not process this input ({type(e).__name__}: {e}); "
                f"check the images and processor kwargs {sorted(merged)}."
            ) from e


@contextmanager
def _quiet_logger(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def load_tokenizer(model_config: ModelConfig) -> Any:
    return AutoTokenizer.from_pretrained(model_config.tokenizer, trust_remote_code=model_config.trust_remote_code)
