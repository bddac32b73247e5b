"""Access to the model's HF config, tokenizer and processor for the processing classes.

`mm_processor_kwargs` (the model config's, overridden key by key by a request's) go where the HF
processor takes them, as in vLLM: to its constructor (`AutoProcessor.from_pretrained`) when the
processor's or one of its sub-processors' ``__init__`` names the key (e.g. LLaVA's
``vision_feature_select_strategy``, ``patch_size``), and to its call when the call takes the key
(e.g. ``do_normalize``, by the processor's typed ``**kwargs``); ``use_fast`` goes to from_pretrained.
A key both take goes to the call only.
Keys that neither takes are dropped with one warning per distinct set of them, never an error.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import typing
from collections import OrderedDict
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any, Optional, TypeVar

import typing_extensions
from transformers import AutoProcessor, AutoTokenizer, BatchFeature, PretrainedConfig, ProcessorMixin
from transformers.image_utils import SizeDict

from ..config import ModelConfig
from ..gguf_file import find_gguf_file, load_gguf_tokenizer
from .hf_compat import restore_legacy_layout

logger = logging.getLogger(__name__)

_C = TypeVar("_C", bound=PretrainedConfig)
_P = TypeVar("_P", bound=ProcessorMixin)

MAX_CACHED_PROCESSORS = 8
"""HF processors kept per context for distinct constructor kwargs (requests can ask for new ones)."""

_MAX_WARNED_KEY_SETS = 256
_UNPACK = tuple({typing.Unpack, typing_extensions.Unpack})
_RESERVED = frozenset({"return_tensors"})  # we always ask for torch tensors
_LOADER_OPTIONS = frozenset({"use_fast"})  # from_pretrained's own: the fast or slow (image) processor class


class InputProcessingContext:
    def __init__(self, model_config: ModelConfig, tokenizer: Any = None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_config)
        self._base: Optional[ProcessorMixin] = None
        self._processors: OrderedDict[Any, ProcessorMixin] = OrderedDict()
        self._lock = threading.RLock()  # processing runs on worker threads in the server
        self._warned: OrderedDict[frozenset[str], None] = OrderedDict()

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
        an item's tokens as HF will): `base` (the sub-processor's own settings), then the processor class's
        call-time defaults (its ``images_kwargs`` / ``videos_kwargs``... class attributes), then the merged
        mm_processor_kwargs, flat or nested under ``images_kwargs`` / ``videos_kwargs``."""
        keys = tuple(keys)
        settings = {key: base.get(key) for key in keys}
        processor_class = type(self._base_processor())
        merged = self.get_merged_mm_kwargs(kwargs)
        layers = [getattr(processor_class, name, None) for name in _CALL_DEFAULTS]
        layers += [merged] + [merged.get(name) for name in _CALL_DEFAULTS]
        for layer in layers:
            if isinstance(layer, Mapping):
                settings.update({key: layer[key] for key in keys if layer.get(key) is not None})
        return settings

    def get_hf_processor(self, typ: type[_P] = ProcessorMixin, /, **kwargs: object) -> _P:  # type: ignore[assignment]
        """The model folder's HF processor, sharing our tokenizer, built with the merged
        mm_processor_kwargs that its constructor takes (see the module docstring). One instance per
        distinct set of constructor kwargs is kept (the MAX_CACHED_PROCESSORS most recently used)."""
        base = self._base_processor()
        merged = self.get_merged_mm_kwargs(kwargs)
        merged.pop("tokenizer", None)
        constructor_kwargs = _size_dicts(base, split_mm_kwargs(base, merged).constructor)
        processor = self._processor_with(constructor_kwargs) if constructor_kwargs else base
        _check_type(processor, typ, self.model_config.model)
        return processor  # type: ignore[return-value]

    def _base_processor(self) -> ProcessorMixin:
        """The processor as the model folder defines it: what kwargs are checked against."""
        with self._lock:
            if self._base is None:
                self._base = self._load_processor({})
            return self._base

    def _processor_with(self, constructor_kwargs: dict[str, object]) -> ProcessorMixin:
        key = _freeze(constructor_kwargs)
        with self._lock:
            processor = self._processors.get(key)
            if processor is not None:
                self._processors.move_to_end(key)
                return processor
        try:  # outside the lock: a request's new kwargs do not hold up the others' processing
            processor = self._load_processor(constructor_kwargs)
        except Exception as e:
            raise ValueError(
                f"The HF processor could not be built with mm_processor_kwargs {_names(constructor_kwargs)} "
                f"({type(e).__name__}: {e})."
            ) from e
        with self._lock:
            processor = self._processors.setdefault(key, processor)  # another thread's, if it was first
            self._processors.move_to_end(key)
            while len(self._processors) > MAX_CACHED_PROCESSORS:
                self._processors.popitem(last=False)
        return processor

    def _load_processor(self, kwargs: Mapping[str, object]) -> ProcessorMixin:
        with _quiet_logger("transformers.models.auto.image_processing_auto"):  # "slow processor" notice
            return AutoProcessor.from_pretrained(
                self.model_config.model,
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
        it was built (get_hf_processor); keys neither takes are dropped with a warning."""
        merged = self.get_merged_mm_kwargs(kwargs)
        split = split_mm_kwargs(hf_processor, merged, data_keys=data.keys())
        if split.dropped:
            self._warn_dropped(hf_processor, split.dropped)
        try:
            outputs = hf_processor(**data, **split.call, return_tensors="pt")
        except Exception as e:
            used = [key for key in merged if key not in split.dropped]
            raise ValueError(
                f"{_name_of(hf_processor)} could not process this input ({type(e).__name__}: {e}); "
                f"check the images and processor kwargs {_names(used)}."
            ) from e
        return restore_legacy_layout(hf_processor, data, outputs)

    def _warn_dropped(self, hf_processor: Any, dropped: list[str]) -> None:
        key = frozenset(dropped)
        with self._lock:
            if key in self._warned:
                return
            self._warned[key] = None
            while len(self._warned) > _MAX_WARNED_KEY_SETS:
                self._warned.popitem(last=False)
        logger.warning(
            "Ignoring mm_processor_kwargs %s: %s takes none of them as an option (in its constructor or its call).",
            _names(dropped),
            _name_of(hf_processor),
        )


class MMKwargsSplit(typing.NamedTuple):
    constructor: dict[str, object]
    """For `AutoProcessor.from_pretrained` (the processor's or a sub-processor's __init__ names them)."""
    call: dict[str, object]
    """For the processor's call."""
    dropped: list[str]
    """Taken by neither (or reserved: the data's own names, return_tensors)."""


def split_mm_kwargs(
    hf_processor: Any, kwargs: Mapping[str, object], data_keys: typing.Iterable[str] = ()
) -> MMKwargsSplit:
    """Which of `kwargs` go to the constructor of `hf_processor`, which to its call, which nowhere.
    A call with untyped ``**kwargs`` takes every key the constructor does not name (as vLLM)."""
    init_names = constructor_kwarg_names(hf_processor) if isinstance(hf_processor, ProcessorMixin) else frozenset()
    call_names, open_call, data_params = call_kwarg_names(hf_processor)
    reserved = _RESERVED | data_params | set(data_keys)
    constructor, call, dropped = {}, {}, []
    for key, value in kwargs.items():
        if key in reserved:
            dropped.append(key)
        elif key in call_names:
            call[key] = value
        elif key in init_names:
            constructor[key] = value
        elif open_call:
            call[key] = value
        else:
            dropped.append(key)
    return MMKwargsSplit(constructor, call, dropped)


_INIT_NAMES: dict[tuple, frozenset[str]] = {}


def constructor_kwarg_names(processor: ProcessorMixin) -> frozenset[str]:
    """Keys `AutoProcessor.from_pretrained` applies to this processor: parameters named by the
    __init__ of the processor or of one of its sub-processors (image processor...; not the
    tokenizer, which is ours) that the instance keeps as an attribute, and ``use_fast``."""
    get_attributes = getattr(type(processor), "get_attributes", None)  # transformers 5; 4.x: .attributes
    attributes = list(get_attributes() if get_attributes else getattr(processor, "attributes", []))
    owners = [processor] + [getattr(processor, a, None) for a in attributes if a != "tokenizer"]
    cache_key = tuple(type(owner) for owner in owners)
    names = _INIT_NAMES.get(cache_key)
    if names is None:
        found: set[str] = set()
        for owner in owners:
            if owner is not None:
                found |= {name for name in _named_parameters(type(owner).__init__) if hasattr(owner, name)}
        names = _INIT_NAMES[cache_key] = frozenset(found - set(attributes) - {"tokenizer", "self"}) | _LOADER_OPTIONS
    return names


_CALL_NAMES: dict[type, tuple[frozenset[str], bool, frozenset[str]]] = {}


def call_kwarg_names(fn: Callable[..., Any]) -> tuple[frozenset[str], bool, frozenset[str]]:
    """(keyword names the call takes, whether it takes any other keyword too, names that are the
    data of a processor's call: text, images...). Typed ``**kwargs: Unpack[SomeProcessorKwargs]``
    (transformers' processors) name their keys, also those nested in text_kwargs, images_kwargs..."""
    if isinstance(fn, ProcessorMixin):  # one answer per processor class
        names = _CALL_NAMES.get(type(fn))
        if names is None:
            names = _CALL_NAMES[type(fn)] = _call_kwarg_names(fn)
        return names
    return _call_kwarg_names(fn)


def _call_kwarg_names(fn: Callable[..., Any]) -> tuple[frozenset[str], bool, frozenset[str]]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: pass everything, as vLLM
        return frozenset(), True, frozenset()
    names: set[str] = set()
    open_call = False
    data_params: set[str] = set()
    for param in signature.parameters.values():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            typed = _typed_kwargs_names(param.annotation)
            if typed is None:
                open_call = True
            else:
                names |= typed
        elif param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and isinstance(fn, ProcessorMixin):
            data_params.add(param.name)  # text, images, audio, videos: data, not options
        elif param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(param.name)
    if isinstance(fn, ProcessorMixin) and not open_call:
        names |= _call_default_names(type(fn))
    return frozenset(names - data_params), open_call, frozenset(data_params)


_CALL_DEFAULTS = ("text_kwargs", "images_kwargs", "videos_kwargs", "audio_kwargs")


def _call_default_names(processor_class: type) -> set[str]:
    """Keys a transformers 5 processor class gives call-time defaults (class attributes such as Gemma 3's
    ``images_kwargs = {"do_pan_and_scan": False, ...}``) and its ``valid_processor_kwargs`` names: the call
    takes them, and its defaults override what a sub-processor was constructed with, so they must go to
    the call to count."""
    names: set[str] = set()
    for attribute in _CALL_DEFAULTS:
        defaults = getattr(processor_class, attribute, None)
        if isinstance(defaults, Mapping):
            names |= set(defaults)
    valid = getattr(processor_class, "valid_processor_kwargs", None)
    if typing_extensions.is_typeddict(valid):
        names |= _typed_kwargs_names(typing_extensions.Unpack[valid]) or set()
    return names


def _typed_kwargs_names(annotation: Any) -> Optional[set[str]]:
    """The keys of ``Unpack[TypedDict]`` (with those of nested TypedDicts), None if not that form."""
    if typing.get_origin(annotation) not in _UNPACK:
        return None
    (typed_dict,) = typing.get_args(annotation)
    fields = getattr(typed_dict, "__annotations__", None)
    if not isinstance(fields, Mapping):
        return None
    names = set(fields)
    for value in fields.values():
        if typing_extensions.is_typeddict(value):
            names |= set(getattr(value, "__annotations__", {}))
    return names


def _named_parameters(fn: Callable[..., Any]) -> list[str]:
    """Keyword parameter names of `fn`, with the keys of a typed ``**kwargs: Unpack[...]`` (how
    transformers 5 image processors declare their __init__ options)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = [p.name for p in parameters if p.kind in kinds]
    for p in parameters:
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            names += sorted(_typed_kwargs_names(p.annotation) or ())
    return names


_SIZE_DICT_FIELDS = frozenset(f.name for f in dataclasses.fields(SizeDict))


def _size_dicts(processor: ProcessorMixin, kwargs: dict[str, object]) -> dict[str, object]:
    """JSON mappings for options a transformers 5 (sub-)processor holds as a SizeDict (sizes,
    patch sizes), which its constructor refuses as plain dicts, become SizeDicts."""
    get_attributes = getattr(type(processor), "get_attributes", None)
    owners = [processor] + [getattr(processor, a, None) for a in (get_attributes() if get_attributes else [])]
    converted = dict(kwargs)
    for key, value in kwargs.items():
        if (
            isinstance(value, Mapping)
            and set(value) <= _SIZE_DICT_FIELDS  # other keys: left for the processor to refuse by name
            and any(isinstance(getattr(o, key, None), SizeDict) for o in owners)
        ):
            converted[key] = SizeDict(**value)
    return converted


def _freeze(value: Any) -> Any:
    """A hashable, order-independent stand-in for kwargs values (JSON-like: dicts, lists, scalars)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return (type(value).__name__, repr(value))


def _names(keys: typing.Iterable[str], limit: int = 10) -> str:
    """Key names for a message, each and all of them bounded (they can come from a request)."""
    shown = [k if len(k) <= 60 else k[:57] + "..." for k in sorted(map(str, keys))]
    more = f" and {len(shown) - limit} more" if len(shown) > limit else ""
    return "[" + ", ".join(repr(k) for k in shown[:limit]) + "]" + more


def _name_of(fn: Any) -> str:
    return fn.__name__ if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__name__


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


def load_tokenizer(model_config: ModelConfig) -> Any:
    """The tokenizer of the model's folder (or of `model_config.tokenizer`); for a GGUF file, the
    one transformers converts from it, with the file's special tokens and BOS / EOS flags enforced."""
    gguf_file = find_gguf_file(model_config.tokenizer)
    if gguf_file is not None:
        return load_gguf_tokenizer(gguf_file, trust_remote_code=model_config.trust_remote_code)
    return AutoTokenizer.from_pretrained(model_config.tokenizer, trust_remote_code=model_config.trust_remote_code)
