"""A tiny, randomly initialised ColQwen2 retrieval checkpoint (ColQwen2ForRetrieval) in Hugging Face folder format,
built offline: the tiny Qwen2-VL of testkit/qwen_vl.py as its vlm, 16-dimensional token embeddings, and
ColQwen2Processor's files (its image processor and tokenizer; the default visual prompt and query prefix)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from transformers import AutoConfig, AutoProcessor, ColQwen2Config, ColQwen2ForRetrieval, ColQwen2Processor

from .checkpoints import save_widened_random_weights
from .qwen_vl import build_tiny_qwen2_vl

EMBEDDING_DIM = 16


def build_tiny_colqwen2(folder, *, seed: int = 0) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer, processor) to `folder`; returns it."""
    folder = Path(folder)
    with tempfile.TemporaryDirectory() as scratch:
        vlm = build_tiny_qwen2_vl(Path(scratch) / "vlm", seed=seed)
        config = ColQwen2Config(vlm_config=AutoConfig.from_pretrained(vlm).to_dict(), embedding_dim=EMBEDDING_DIM)
        save_widened_random_weights(ColQwen2ForRetrieval, config, folder, seed)
        parts = AutoProcessor.from_pretrained(vlm)
        ColQwen2Processor(image_processor=parts.image_processor, tokenizer=parts.tokenizer).save_pretrained(folder)
    return folder
