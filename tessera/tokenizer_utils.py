"""Loading a model's tokenizer: from its folder (or `ModelConfig.tokenizer`), or converted from a GGUF file."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Optional

from transformers import AutoTokenizer

from .config import ModelConfig
from .gguf_file import find_gguf_file, load_gguf_tokenizer
from .gguf_vlm import named_tokens

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(model_config: ModelConfig) -> Any:
    """The tokenizer of the model's folder (or of `model_config.tokenizer`); for a GGUF file, the
    one transformers converts from it, with the file's special tokens and BOS / EOS flags enforced.
    A folder whose only tokenizer is mistral-common's `tekken.json` (Voxtral) gets transformers'
    MistralCommonBackend; one that also has Hugging Face tokenizer files keeps those (as before
    mistral-common was installed: transformers would otherwise prefer tekken.json)."""
    gguf_file = find_gguf_file(model_config.tokenizer)
    if gguf_file is not None:
        named = named_tokens(gguf_file, model_config.mmproj) if model_config.mmproj else {}  # the processor reads
        return load_gguf_tokenizer(gguf_file, trust_remote_code=model_config.trust_remote_code, **named)
    folder = Path(model_config.tokenizer)
    options: dict[str, Any] = {}
    if folder.is_dir() and any((folder / name).is_file() for name in HF_TOKENIZER_FILES):
        options["mistral_format"] = False
    return AutoTokenizer.from_pretrained(
        model_config.tokenizer, trust_remote_code=model_config.trust_remote_code, **options
    )


_cache: dict[tuple[str, bool, Optional[str]], Any] = {}
_cache_lock = threading.Lock()


def cached_tokenizer(model_config: ModelConfig) -> Any:
    """`load_tokenizer`, once per tokenizer folder (for class methods that have only the config, as vLLM's
    `cached_tokenizer_from_config`)."""
    key = (str(model_config.tokenizer), bool(model_config.trust_remote_code), model_config.mmproj)
    with _cache_lock:
        if key not in _cache:
            _cache[key] = load_tokenizer(model_config)
        return _cache[key]
