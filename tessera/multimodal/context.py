"""Access to the model's HF config, tokenizer and processor for the processing classes.

`mm_processor_kwargs` (the model config's, overridden key by key by a request's) go where the HF
processor takes them, by vLLM's rule (processor_options.py): to its constructor when its or a
sub-processor's ``__init__`` names the key (a transformers processor is built by
`AutoProcessor.from_pretrained`, any other processor class a model's info names by its own
constructor), to its call when the call takes it, to both when both do. A key that no part takes is
refused with an error naming the options the processor takes: a misspelt option never goes unseen.
"""

from __future__ import annotations

import logging
import threading
import typing
from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any, Optional, TypeVar

from transformers import AutoProcessor, BatchFeature, PretrainedConfig, ProcessorMixin

from ..config import ModelConfig
from ..tokenizer_utils import load_tokenizer
from .hf_compat import restore_legacy_layout
from .processor_options import (
    call_settings,
    constructor_kwargs_for,
    freeze,
    name_of,
    option_names,
    size_dicts,
    split_mm_kwargs,
)

logger = logging.getLogger(__name__)

_C = TypeVar("_C", bound=PretrainedConfig)
_P = TypeVar("_P")

MAX_CACHED_PROCESSORS = 8
"""HF processors kept per context for distinct constructor kwargs (requests can ask for new ones)."""


class InputProcessingContext:
    def __init__(self, model_config: ModelConfig, tokenizer: Any = None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_config)
        self._base: Optional[ProcessorMixin] = None
        self._processors: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.RLock()  # processing runs on worker threads in the server

    def get_hf_config(self, typ: type[_C] = PretrainedConfig) -> _C:  # type: ignore[assignment]
        hf_config = self.model_config.hf_config
        if not isinstance(hf_config, typ):
            raise TypeError(f"Expected the model config to be a {typ.__name__}, found {type(hf_config).__name__}")
        return hf_config

    def get_merged_mm_kwargs(self, kwargs: Mapping[str, object]) -> dict[str, object]:
        """The model config's mm_processor_kwargs, overridden by `kwargs` (a request's)."""
        return {**self.model_config.multimodal_config.mm_processor_kwargs, **kwargs}

    def get_call_settings(
        self, keys: typing.Iterable[str], base: Mapping[str, object], kwargs: Mapping[str, object] = {}
    ) -> dict[str, object]:
        """The values of `keys` the HF processor's call uses (e.g. an image processor's tiling options, to count
        an item's tokens as HF will), with the merged mm_processor_kwargs: `processor_options.call_settings`."""
        return call_settings(type(self._base_processor()), keys, base, self.get_merged_mm_kwargs(kwargs))

    def get_hf_processor(self, typ: type[_P] = ProcessorMixin, /, **kwargs: object) -> _P:  # type: ignore[assignment]
        """The model's processor, built with the merged mm_processor_kwargs that its constructor
        takes (see the module docstring): for `typ` a transformers processor (the default), the model
        folder's, sharing our tokenizer; for any other class, `typ` itself, given our tokenizer if it
        takes one (as vLLM builds one). One instance per distinct set of constructor kwargs is kept
        (the MAX_CACHED_PROCESSORS most recently used)."""
        merged = self.get_merged_mm_kwargs(kwargs)
        merged.pop("tokenizer", None)
        if not (isinstance(typ, type) and issubclass(typ, ProcessorMixin)):
            return self._processor_of_class(typ, merged)
        base = self._base_processor()
        constructor_kwargs = size_dicts(base, split_mm_kwargs(base, merged).constructor)
        processor = base
        if constructor_kwargs:
            load = lambda: self._load_processor(constructor_kwargs)  # noqa: E731
            processor = self._processor_with(freeze(constructor_kwargs), load)
        _check_type(processor, typ, self.model_config.model)
        return processor  # type: ignore[return-value]

    def _processor_of_class(self, typ: type[_P], merged: dict[str, object]) -> _P:
        """A processor class that is not a transformers processor, built with the merged kwargs its
        constructor names (and our tokenizer, if it takes one)."""
        constructor_kwargs = constructor_kwargs_for(typ, {"tokenizer": self.tokenizer, **merged})
        options = {key: value for key, value in constructor_kwargs.items() if key != "tokenizer"}
        return self._processor_with((typ, freeze(options)), lambda: typ(**constructor_kwargs))

    def _base_processor(self) -> ProcessorMixin:
        """The processor as the model folder defines it: what kwargs are checked against."""
        with self._lock:
            if self._base is None:
                self._base = self._load_processor({})
            return self._base

    def _processor_with(self, key: Any, build: Callable[[], Any]) -> Any:
        with self._lock:
            processor = self._processors.get(key)
            if processor is not None:
                self._processors.move_to_end(key)
                return processor
        try:  # outside the lock: a request's new kwargs do not hold up the others' processing
            processor = build()
        except Exception as e:
            raise ValueError(
                f"The HF processor could not be built with these mm_processor_kwargs ({type(e).__name__}: {e})."
            ) from e
        with self._lock:
            processor = self._processors.setdefault(key, processor)  # another thread's, if it was first
            self._processors.move_to_end(key)
            while len(self._processors) > MAX_CACHED_PROCESSORS:
                self._processors.popitem(last=False)
        return processor

    def _load_processor(self, kwargs: Mapping[str, object]) -> ProcessorMixin:
        if type(self.tokenizer).__name__ == "MistralCommonBackend":  # transformers refuses it as an argument
            processor = AutoProcessor.from_pretrained(
                self.model_config.processor_folder, trust_remote_code=self.model_config.trust_remote_code, **kwargs
            )
            processor.tokenizer = self.tokenizer  # ours: one tokenizer for the processor and the engine
            return processor
        with _quiet_logger("transformers.models.auto.image_processing_auto"):  # "slow processor" notice
            return AutoProcessor.from_pretrained(
                self.model_config.processor_folder,
                tokenizer=self.tokenizer,
                trust_remote_code=self.model_config.trust_remote_code,
                **kwargs,
            )

    def get_call_kwargs(self, hf_processor: Any, kwargs: Mapping[str, object]) -> dict[str, object]:
        """The merged mm_processor_kwargs that `hf_processor`'s call takes (as call_hf_processor passes them)."""
        return split_mm_kwargs(hf_processor, self.get_merged_mm_kwargs(kwargs)).call

    def call_hf_processor(
        self, hf_processor: Callable[..., Any], data: Mapping[str, object], kwargs: Mapping[str, object] = {}
    ) -> BatchFeature:
        """Call the HF processor on `data` (text, images...) with the merged mm_processor_kwargs
        that its call takes, returning torch tensors. Keys its constructor takes were applied when
        it was built (get_hf_processor); keys its call does not take are not passed to it (the model's
        keys were checked against the processor as a whole: `check_mm_kwargs`)."""
        merged = self.get_merged_mm_kwargs(kwargs)
        split = split_mm_kwargs(hf_processor, merged, data_keys=data.keys())
        try:
            outputs = hf_processor(**data, **size_dicts(hf_processor, split.call), return_tensors="pt")
        except Exception as e:
            used = [key for key in merged if key not in split.dropped]
            raise ValueError(
                f"{name_of(hf_processor)} could not process this input ({type(e).__name__}: {e}); "
                f"check the inputs and processor kwargs {option_names(used)}."
            ) from e
        return restore_legacy_layout(hf_processor, data, outputs)


def _check_type(processor: Any, typ: type, model: str) -> None:
    if not isinstance(processor, typ):
        raise TypeError(f"Expected a {typ.__name__} in {model}, found {type(processor).__name__}")


@contextmanager
def _quiet_logger(name: str):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
