"""Which mm_processor_kwargs a processor takes, and where each goes: vLLM's rule.

A key goes to the processor's constructor when its or one of its sub-processors' ``__init__``
names it (for a transformers processor, `AutoProcessor.from_pretrained` applies it; for any other
processor class a model's info names, its own ``__init__`` gets it), and to its call when the call
takes it: the typed ``**kwargs`` of a transformers processor's ``__call__``, the keys its class gives
call-time defaults, and every key a sub-processor's ``valid_kwargs`` declares (what HF's
``_merge_kwargs`` routes, including names it still accepts under deprecation, such as Qwen-VL's
``min_pixels`` / ``max_pixels``). A key both take goes to both, as in vLLM. A call with untyped
``**kwargs`` takes every key. A key no part takes is refused by `check_mm_kwargs`, naming the options
the processor does take.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import typing_extensions
from transformers import ProcessorMixin
from transformers.image_utils import SizeDict

_UNPACK = tuple({typing.Unpack, typing_extensions.Unpack})
RESERVED = frozenset({"return_tensors"})  # we always ask for torch tensors
DATA_NAMES = frozenset({"text", "images", "videos", "audio", "audios"})  # a processor call's inputs, not options
LOADER_OPTIONS = frozenset({"use_fast"})  # from_pretrained's own: the fast or slow (image) processor class
CALL_DEFAULTS = ("text_kwargs", "images_kwargs", "videos_kwargs", "audio_kwargs")
_SUB_PROCESSOR_KWARGS = {  # the modality each sub-processor's valid_kwargs serve (HF's _merge_kwargs)
    "tokenizer": "text_kwargs",
    "image_processor": "images_kwargs",
    "video_processor": "videos_kwargs",
    "feature_extractor": "audio_kwargs",
}


class ProcessorOptions(typing.NamedTuple):
    """What one processor takes as options."""

    constructor: frozenset[str]
    call: frozenset[str]
    open_call: bool  # the call has untyped **kwargs: it takes any key
    data: frozenset[str]  # the names of the call's data (text, images...): never options

    def takes(self, key: str) -> bool:
        return key not in self.data and key not in RESERVED and (
            self.open_call or key in self.call or key in self.constructor
        )


class MMKwargsSplit(typing.NamedTuple):
    constructor: dict[str, object]
    """For `AutoProcessor.from_pretrained`, or the constructor of a processor class of another kind."""
    call: dict[str, object]
    """For the processor's call."""
    dropped: list[str]
    """Taken by neither (or reserved: the data's own names, return_tensors)."""


def split_mm_kwargs(hf_processor: Any, kwargs: Mapping[str, object], data_keys: Iterable[str] = ()) -> MMKwargsSplit:
    """Which of `kwargs` go to the constructor of `hf_processor` (an instance, or a function
    standing for a call), which to its call (both, where both take a key), which nowhere."""
    options = processor_options(hf_processor)
    reserved = RESERVED | options.data | set(data_keys)
    constructor, call, dropped = {}, {}, []
    for key, value in kwargs.items():
        if key in reserved or not options.takes(key):
            dropped.append(key)
            continue
        if key in options.constructor:
            constructor[key] = value
        if options.open_call or key in options.call:
            call[key] = value
    return MMKwargsSplit(constructor, call, dropped)


def check_mm_kwargs(hf_processor: Any, kwargs: Mapping[str, object]) -> None:
    """Refuse (ValueError) the keys of `kwargs` that no part of `hf_processor` takes, naming them,
    the nearest option names, and every option the processor takes."""
    options = processor_options(hf_processor)
    unknown = sorted(str(key) for key in kwargs if not options.takes(key))
    if not unknown:
        return
    valid = sorted((options.call | options.constructor) - RESERVED)
    close = {key: difflib.get_close_matches(key[:60], valid, n=1) for key in unknown}
    hints = "; ".join(f"did you mean {match[0]!r} for {key[:60]!r}?" for key, match in close.items() if match)
    raise ValueError(
        f"mm_processor_kwargs {option_names(unknown)} {'is not an option' if len(unknown) == 1 else 'are not options'} "
        f"of {name_of(hf_processor)}{' (' + hints + ')' if hints else ''}. It takes: {', '.join(valid)}."
    )


# ---- what a processor takes ------------------------------------------------------------------------

_OPTIONS: dict[tuple, ProcessorOptions] = {}


def processor_options(hf_processor: Any) -> ProcessorOptions:
    """The options of a processor instance (one answer per processor and sub-processor classes), of
    a processor class, or of a plain function standing for a call (its keyword parameters)."""
    if inspect.isfunction(hf_processor) or inspect.ismethod(hf_processor):
        call, open_call, _ = _signature_names(hf_processor, data_params=False)
        return ProcessorOptions(frozenset(), call, open_call, frozenset())
    owners = _owners(hf_processor)
    key = tuple(type(owner) if not isinstance(owner, type) else owner for owner in owners)
    options = _OPTIONS.get(key)
    if options is None:
        options = _OPTIONS[key] = _processor_options(hf_processor, owners)
    return options


def _owners(hf_processor: Any) -> list[Any]:
    """The processor and its sub-processors (image processor...; not the tokenizer, which is ours)."""
    return [hf_processor] + [sub for name, sub in sub_processors(hf_processor).items() if name != "tokenizer"]


def sub_processors(hf_processor: Any) -> dict[str, Any]:
    """A transformers processor's sub-processors by attribute name (tokenizer, image_processor...)."""
    if not isinstance(hf_processor, ProcessorMixin):
        return {}
    get_attributes = getattr(type(hf_processor), "get_attributes", None)  # transformers 5; 4.x: .attributes
    names = list(get_attributes() if get_attributes else getattr(hf_processor, "attributes", []))
    return {name: sub for name in names if (sub := getattr(hf_processor, name, None)) is not None}


def _processor_options(hf_processor: Any, owners: list[Any]) -> ProcessorOptions:
    processor_class = hf_processor if isinstance(hf_processor, type) else type(hf_processor)
    is_hf = issubclass(processor_class, ProcessorMixin)
    constructor: set[str] = set()
    for owner in owners:
        owner_class = owner if isinstance(owner, type) else type(owner)
        constructor |= set(_named_parameters(owner_class.__init__))
    constructor -= set(sub_processors(hf_processor)) | {"tokenizer", "self", "args", "kwargs"}
    if is_hf:
        constructor |= LOADER_OPTIONS
    call, open_call, data = _signature_names(processor_class.__call__, data_params=is_hf)
    if is_hf and not open_call:
        call |= _call_default_names(processor_class)
        for name, sub in sub_processors(hf_processor).items():
            valid = getattr(sub, "valid_kwargs", None)
            if name in _SUB_PROCESSOR_KWARGS and typing_extensions.is_typeddict(valid):
                call |= set(getattr(valid, "__annotations__", {}))
    return ProcessorOptions(frozenset(constructor), frozenset(call - data), open_call, data)


def _signature_names(fn: Callable[..., Any], *, data_params: bool) -> tuple[frozenset[str], bool, frozenset[str]]:
    """(keyword names `fn` takes, whether it takes any other keyword too, its data parameters: for a
    transformers processor's call, its inputs (text, images...); its other parameters, such as
    Idefics3's image_seq_len, are options)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: pass everything, as vLLM
        return frozenset(), True, frozenset()
    names: set[str] = set()
    data: set[str] = set()
    open_call = False
    for param in signature.parameters.values():
        if param.name == "self":
            continue
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            typed = _typed_kwargs_names(param.annotation)
            open_call = open_call or typed is None
            names |= typed or set()
        elif param.name in DATA_NAMES and data_params:
            data.add(param.name)
        elif param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(param.name)
    return frozenset(names - data), open_call, frozenset(data)


def _call_default_names(processor_class: type) -> set[str]:
    """Keys a transformers 5 processor class gives call-time defaults (class attributes such as Gemma 3's
    ``images_kwargs = {"do_pan_and_scan": False, ...}``) and its ``valid_processor_kwargs`` names: the call
    takes them, and its defaults override what a sub-processor was constructed with."""
    names: set[str] = set()
    for attribute in CALL_DEFAULTS:
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


def call_settings(
    processor_class: type, keys: Iterable[str], base: Mapping[str, object], merged: Mapping[str, object]
) -> dict[str, object]:
    """The values of `keys` a processor's call uses: `base` (a sub-processor's own settings), then the processor
    class's call-time defaults (its ``images_kwargs`` / ``videos_kwargs``... class attributes), then the merged
    mm_processor_kwargs, flat or nested under ``images_kwargs`` / ``videos_kwargs``."""
    keys = tuple(keys)
    settings = {key: base.get(key) for key in keys}
    layers = [getattr(processor_class, name, None) for name in CALL_DEFAULTS]
    layers += [merged] + [merged.get(name) for name in CALL_DEFAULTS]
    for layer in layers:
        if isinstance(layer, Mapping):
            settings.update({key: layer[key] for key in keys if layer.get(key) is not None})
    return settings


def constructor_kwargs_for(processor_class: type, kwargs: Mapping[str, object]) -> dict[str, object]:
    """The keys of `kwargs` a processor class of another kind than transformers' takes in its
    constructor (all of them if its ``__init__`` has untyped ``**kwargs``), as vLLM builds one."""
    try:
        parameters = inspect.signature(processor_class.__init__).parameters.values()
    except (TypeError, ValueError):
        return dict(kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD and _typed_kwargs_names(p.annotation) is None for p in parameters):
        return dict(kwargs)
    names = set(_named_parameters(processor_class.__init__)) - {"self"}
    return {key: value for key, value in kwargs.items() if key in names}


# ---- values ----------------------------------------------------------------------------------------

_SIZE_DICT_FIELDS = frozenset(f.name for f in dataclasses.fields(SizeDict))


def size_dicts(hf_processor: Any, kwargs: dict[str, object]) -> dict[str, object]:
    """JSON mappings (as a CLI or server user writes them) for options that a transformers 5
    (sub-)processor declares as a SizeDict only (Fuyu's patch_size), which it refuses as plain dicts,
    become SizeDicts; options typed as dicts (sizes) stay dicts."""
    converted = dict(kwargs)
    for key, value in kwargs.items():
        if isinstance(value, Mapping) and set(value) <= _SIZE_DICT_FIELDS and _takes_size_dict_only(hf_processor, key):
            converted[key] = SizeDict(**value)
    return converted


def _takes_size_dict_only(hf_processor: Any, key: str) -> bool:
    """Whether a (sub-)processor declares option `key` as a SizeDict and not as a dict. Read from the
    annotation's text: annotations may be strings that do not resolve (``from __future__ import
    annotations`` in another module)."""
    for owner in (hf_processor, *sub_processors(hf_processor).values()):
        valid = getattr(owner, "valid_kwargs", None)
        annotations = getattr(valid, "__annotations__", {}) if typing_extensions.is_typeddict(valid) else {}
        if key in annotations:
            text = annotations[key] if isinstance(annotations[key], str) else repr(annotations[key])
            return "SizeDict" in text and "dict[" not in text.replace("SizeDict", "") and "Mapping" not in text
        if not annotations and isinstance(getattr(owner, key, None), SizeDict):  # no declared options: as held
            return True
    return False


def freeze(value: Any) -> Any:
    """A hashable, order-independent stand-in for kwargs values (JSON-like: dicts, lists, scalars)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return (type(value).__name__, repr(value))


def option_names(keys: Iterable[str], limit: int = 10) -> str:
    """Key names for a message, each and all of them bounded (they can come from a request)."""
    shown = [k if len(k) <= 60 else k[:57] + "..." for k in sorted(map(str, keys))]
    more = f" and {len(shown) - limit} more" if len(shown) > limit else ""
    return "[" + ", ".join(repr(k) for k in shown[:limit]) + "]" + more


def name_of(fn: Any) -> str:
    if isinstance(fn, type):
        return fn.__name__
    return fn.__name__ if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__name__


# ---- how much work a request may ask for -------------------------------------------------------------

MAX_REQUEST_SIDE = 8192
"""The most a request's option may give a side of an image (an edge length, a tile count...)."""
MAX_REQUEST_PIXELS = MAX_REQUEST_SIDE**2
"""The most a request's option may give a pixel count (min_pixels, max_pixels, Qwen-VL's size edges)."""


def check_request_magnitudes(hf_processor: Any, kwargs: Mapping[str, object]) -> None:
    """Refuse (ValueError) a request's numbers that would have the processor make an image larger than
    MAX_REQUEST_SIDE on a side, e.g. ``size: {"shortest_edge": 50000}``, which would allocate tens of GB.
    A number counts pixels where its name says so (``max_pixels``), where the processor's own value for
    the same option is already over MAX_REQUEST_SIDE, or where it is a size edge of a processor that
    takes ``max_pixels`` for it (Qwen-VL's ``size.longest_edge``); such a number may reach
    MAX_REQUEST_PIXELS."""
    owners = [hf_processor, *sub_processors(hf_processor).values()]

    def walk(value: Any, path: tuple[str, ...], where: str) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, (*path, str(key)[:60]), f"{where}.{str(key)[:60]}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, path, f"{where}[{index}]")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            pixels = "pixels" in path[-1] or any(_counts_pixels(o, path) for o in owners)
            limit = MAX_REQUEST_PIXELS if pixels else MAX_REQUEST_SIDE
            if not abs(value) <= limit:  # NaN too
                raise ValueError(
                    f"{where}={value} is over {limit}: a request may not ask the processor for an image "
                    f"larger than {MAX_REQUEST_SIDE} x {MAX_REQUEST_SIDE} pixels."
                )

    walk(kwargs, (), "mm_processor_kwargs")


def _own_value(owner: Any, path: tuple[str, ...]) -> Any:
    """The option at `path` (``size``, then ``longest_edge``) as `owner` holds it; a path under
    ``images_kwargs`` / ``videos_kwargs``... is looked up without that first key."""
    if path and path[0] in CALL_DEFAULTS:
        path = path[1:]
    value = owner
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else getattr(value, key, None)
        if value is None:
            return None
    return value


def _counts_pixels(owner: Any, path: tuple[str, ...]) -> bool:
    """Whether `owner` reads the option at `path` as a pixel count: its own value is over any side, or
    it is a size edge of a processor that takes min_pixels / max_pixels (HF's names for those edges)."""
    own = _own_value(owner, path)
    if isinstance(own, (int, float)) and not isinstance(own, bool) and own > MAX_REQUEST_SIDE:
        return True
    valid = getattr(getattr(owner, "valid_kwargs", None), "__annotations__", {})
    return "size" in path and path[-1] in ("shortest_edge", "longest_edge") and "max_pixels" in valid
