"""Loading a model's tokenizer: from its folder (or `ModelConfig.tokenizer`), or converted from a GGUF file."""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer

from .config import ModelConfig
from .gguf_file import find_gguf_file, load_gguf_tokenizer


def load_tokenizer(model_config: ModelConfig) -> Any:
    """The tokenizer of the model's folder (or of `model_config.tokenizer`); for a GGUF file, the
    one transformers converts from it, with the file's special tokens and BOS / EOS flags enforced."""
    gguf_file = find_gguf_file(model_config.tokenizer)
    if gguf_file is not None:
        return load_gguf_tokenizer(gguf_file, trust_remote_code=model_config.trust_remote_code)
    return AutoTokenizer.from_pretrained(model_config.tokenizer, trust_remote_code=model_config.trust_remote_code)
