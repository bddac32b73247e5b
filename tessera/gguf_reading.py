"""Reading GGUF files with the `gguf` package, once per file while a model loads.

gguf's `GGUFReader` parses every metadata field into numpy views, a few seconds for a 150k-token vocabulary;
transformers' GGUF conversion parses the file anew for the config, the tokenizer and the weights. `gguf_reader`
keeps the last parses (a language model and its mmproj) until `release_gguf_readers` (the loader calls it once
the weights are in), and `transformers_reading` hands transformers that parse, so a model is parsed once.
`transformers_reading` also reads the language model of a Qwen2-VL / Qwen2.5-VL GGUF (llama.cpp's "qwen2vl")
as the Qwen2 it is for transformers (`ARCHITECTURE_ALIASES`).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Union

ARCHITECTURE_ALIASES = {"qwen2vl": "qwen2", "mistral3": "llama"}
"""Language-model architectures of vision models that llama.cpp names apart but that are, as text models, ones
transformers converts: Qwen2-VL / Qwen2.5-VL's language model is Qwen2's (plus ``rope.dimension_sections``,
M-RoPE's sections, which `tessera.gguf_vlm` reads); Mistral 3's is written as a Llama (q / k rows permuted as
llama.cpp's Llama, which transformers' Llama reading undoes)."""
NOT_UNDER_ALIAS = ("rope.scaling.yarn_log_multiplier", "attention.temperature_scale")
"""Settings an aliased file may carry that the architecture it is read as has no place for."""
_readers_lock = threading.RLock()


@contextlib.contextmanager
def transformers_reading():
    """While open, transformers' GGUF conversion (config, tokenizer, weights: each parses the file anew, seconds
    for a large vocabulary) gets the file's parse that Tessera keeps (`gguf_reader`), and reads an aliased
    architecture (`ARCHITECTURE_ALIASES`) as the one it stands for: its keys and ``general.architecture``
    renamed."""
    import gguf

    def reader(path, *args, **kwargs):
        return _aliased(gguf_reader(str(path)))

    with _readers_lock:  # load_gguf_checkpoint imports the reader from gguf when it runs
        saved, gguf.GGUFReader = gguf.GGUFReader, reader
        try:
            yield
        finally:
            gguf.GGUFReader = saved


def _aliased(reader: Any) -> Any:
    """`reader`, or for an aliased architecture a shallow copy whose fields say the architecture it stands for."""
    import copy

    import numpy as np

    arch = reader.fields.get("general.architecture")
    original = arch.contents() if arch is not None else None
    alias = ARCHITECTURE_ALIASES.get(original)
    if alias is None:
        return reader
    beyond = [key for key in NOT_UNDER_ALIAS if f"{original}.{key}" in reader.fields]
    if beyond:  # e.g. Ministral 3's yarn rope: read as the alias, the model would run without it
        raise ValueError(
            f"This {original!r} GGUF file has {', '.join(beyond)}, which its reading as {alias!r} would drop; "
            "Tessera does not run it."
        )
    fields = {}
    for name, field in reader.fields.items():
        if name == "general.architecture":
            text = np.frombuffer(alias.encode(), dtype=np.uint8)
            field = field._replace(parts=[*field.parts[:-2], np.array([len(text)], dtype=np.uint64), text])
        elif name.startswith(original + "."):
            name = alias + name[len(original) :]
            field = field._replace(name=name)
        fields[name] = field
    aliased = copy.copy(reader)
    aliased.fields = fields
    return aliased


_parsed: "OrderedDict[tuple[str, int, int], Any]" = OrderedDict()
KEPT_PARSES = 2
"""The files whose parse is kept: a language model and its mmproj."""


def gguf_reader(path: Union[str, Path]) -> Any:
    """gguf's `GGUFReader` of the file at `path`, parsed once while a model loads: the last files parsed are kept
    (by path, size and modification time) until `release_gguf_readers`, so a model's config, tokenizer and
    weights take one parse (a 150k-token vocabulary takes seconds) instead of one each. Errors name the file."""
    resolved = Path(path).resolve()
    try:
        stat = resolved.stat()
    except OSError as e:
        raise ValueError(f"The GGUF file {path} cannot be read ({e}).") from e
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    with _readers_lock:
        if key in _parsed:
            _parsed.move_to_end(key)
            return _parsed[key]
    reader = _reader(str(path))
    with _readers_lock:
        _parsed[key] = reader
        while len(_parsed) > KEPT_PARSES:
            _parsed.popitem(last=False)
    return reader


def metadata_values(reader: Any) -> dict[str, Any]:
    """Every metadata value of a parsed file but the vocabulary arrays (``tokenizer.ggml.*`` lists): strings,
    numbers, booleans, and lists of them."""
    values = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or (name.startswith("tokenizer.ggml.") and len(field.data) > 1):
            continue
        value = field.contents()
        values[name] = value.tolist() if hasattr(value, "tolist") else value
    return values


def release_gguf_readers() -> None:
    """Drop the kept parse (`gguf_reader`): called once a model's weights are loaded."""
    with _readers_lock:
        _parsed.clear()


def _reader(path: str) -> Any:
    try:
        from gguf.gguf_reader import GGUFReader  # the class itself, not `transformers_reading`'s stand-in
    except ImportError as e:
        raise ImportError(
            f"Reading the GGUF file {path} needs the gguf package: pip install 'gguf>=0.10' (or tessera[gguf])."
        ) from e
    try:
        return GGUFReader(path)
    except Exception as e:  # not a GGUF file, or a truncated one
        raise ValueError(f"{path} is not a readable GGUF file: truncated or corrupt ({type(e).__name__}: {e}).") from e
