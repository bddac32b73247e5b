"""Messages between a front-end and an engine core in another process, as msgpack without pickle (vLLM's
`v1/serial_utils.py` does the same): a message from the pipe can build Tessera's own data classes, enums and
tensors, and nothing else, so no bytes on the pipe can make the reader run code.

Plain values (None, bool, int, float, str, bytes, lists, dicts with str or int keys) are msgpack's own; the
rest are msgpack extension types:
- tensors and numpy arrays: dtype, shape and raw bytes (any dtype, bfloat16 included; copied once each way);
- tuples, sets, frozensets and slices, so that they come back as what they were;
- a `tessera.*` dataclass or enum, or one of the classes in OBJECT_CLASSES: its class path and its fields.
An object of any other type is refused when encoding (TypeError naming it), and a class path outside those
when decoding (ValueError)."""

from __future__ import annotations

import dataclasses
import enum
import importlib
from typing import Any

import msgpack
import numpy as np
import torch

_TENSOR, _NDARRAY, _TUPLE, _SET, _FROZENSET, _SLICE, _ENUM, _OBJECT = range(1, 9)

OBJECT_CLASSES = frozenset({
    "tessera.multimodal.inputs:MultiModalKwargsItem",  # a UserDict of one item's tensors
    "tessera.multimodal.inputs:MultiModalBatchedField",  # a stateless field kind
})  # fmt: skip
"""Tessera classes that are neither dataclasses nor enums and may still cross the pipe (state: __dict__)."""


def encode(message: Any) -> bytes:
    return msgpack.packb(message, default=_encode_ext, use_bin_type=True, strict_types=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_decode_ext, raw=False, strict_map_key=False)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _encode_ext(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu().contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        return _ext(_TENSOR, [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), raw])
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("A numpy array of Python objects cannot be sent to an engine core process.")
        return _ext(_NDARRAY, [obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes()])
    if isinstance(obj, np.generic):  # a numpy scalar: as the Python number it holds
        return _ext(_NDARRAY, [obj.dtype.str, [], obj.tobytes()])
    if type(obj) is tuple:
        return _ext(_TUPLE, list(obj))
    if type(obj) is set:
        return _ext(_SET, list(obj))
    if type(obj) is frozenset:
        return _ext(_FROZENSET, list(obj))
    if type(obj) is slice:
        return _ext(_SLICE, [obj.start, obj.stop, obj.step])
    if isinstance(obj, enum.Enum) and _allowed(type(obj)):
        return _ext(_ENUM, [_class_path(type(obj)), obj.value])
    if _allowed(type(obj)) and not isinstance(obj, type):
        return _ext(_OBJECT, [_class_path(type(obj)), dict(vars(obj))])
    if isinstance(obj, dict):  # a subclass (OrderedDict, defaultdict ...): as the plain container it is
        return dict(obj)
    if isinstance(obj, list):
        return list(obj)
    raise TypeError(f"{type(obj).__module__}.{type(obj).__qualname__} cannot be sent to an engine core process.")


def _ext(code: int, payload: Any) -> msgpack.ExtType:
    return msgpack.ExtType(code, encode(payload))


def _allowed(cls: type) -> bool:
    if _class_path(cls) in OBJECT_CLASSES:
        return True
    return cls.__module__.split(".")[0] == "tessera" and (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum))


def _resolve(path: str) -> type:
    """The class at `path`, if it is one a message may build."""
    module_name, _, qualname = path.partition(":")
    if module_name.split(".")[0] != "tessera":
        raise ValueError(f"A message names the class {path}, which is not Tessera's; refused.")
    cls: Any = importlib.import_module(module_name)
    for name in qualname.split("."):
        cls = getattr(cls, name)
    if not isinstance(cls, type) or not _allowed(cls):
        raise ValueError(f"A message names {path}, which is not a class a message may build; refused.")
    return cls


def _decode_ext(code: int, data: bytes) -> Any:
    payload = decode(data)
    if code == _TENSOR:
        dtype_name, shape, raw = payload
        dtype = getattr(torch, dtype_name)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"A message holds a tensor of unknown dtype {dtype_name!r}.")
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    if code == _NDARRAY:
        dtype_str, shape, raw = payload
        array = np.frombuffer(raw, dtype=np.dtype(dtype_str)).reshape(shape).copy()
        return array[()] if shape == [] else array
    if code == _TUPLE:
        return tuple(payload)
    if code == _SET:
        return set(payload)
    if code == _FROZENSET:
        return frozenset(payload)
    if code == _SLICE:
        return slice(*payload)
    if code == _ENUM:
        path, value = payload
        return _resolve(path)(value)
    if code == _OBJECT:
        path, state = payload
        cls = _resolve(path)
        obj = cls.__new__(cls)
        obj.__dict__.update(state)  # as unpickling does, without running the class's code
        return obj
    raise ValueError(f"A message holds an unknown extension type {code}.")
