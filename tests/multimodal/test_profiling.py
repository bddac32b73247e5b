"""Dummy inputs and the profiled maximum placeholder tokens per item."""

from __future__ import annotations

import itertools

import pytest
from PIL import Image

from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.profiling import BaseDummyInputsBuilder, MultiModalProfiler


def real_max_tokens(processor, prompt, sizes):
    return max(
        processor.apply(prompt, {"image": Image.new("RGB", size)})["mm_placeholders"]["image"][0].length
        for size in sizes
    )


def test_llava_profiled_max_equals_real_max(tiny_llava_dir):
    processor = MULTIMODAL_REGISTRY.create_processor(tiny_llava_dir)
    sizes = [(8, 8), (32, 32), (200, 20), (20, 200), (333, 111)]
    profiled = MultiModalProfiler(processor).get_mm_max_tokens_per_item(seq_len=4096)
    assert profiled == {"image": real_max_tokens(processor, "<image>", sizes)}


def test_fuyu_profiled_max_equals_real_max(tiny_fuyu_dir):
    processor = MULTIMODAL_REGISTRY.create_processor(tiny_fuyu_dir, mm_processor_cache_gb=0)
    # Fuyu's count depends on the size: sweep sizes around the 48x48 target and 8px patches.
    sizes = list(itertools.product([8, 9, 40, 47, 48, 49, 96, 300], repeat=2))
    profiled = MultiModalProfiler(processor).get_mm_max_tokens_per_item(seq_len=4096)
    # First principles: 6x6 patches, a newline per row, then BOS.
    assert profiled == {"image": 6 * 6 + 6 + 1}
    assert profiled["image"] == real_max_tokens(processor, "Hi", sizes)


def test_registry_exposes_the_profile(tiny_fuyu_dir):
    processor = MULTIMODAL_REGISTRY.create_processor(tiny_fuyu_dir)
    assert MULTIMODAL_REGISTRY.get_max_tokens_per_item_by_modality(processor, 4096) == {"image": 43}


def test_dummy_text_has_one_placeholder_per_item(tiny_llava_dir):
    processor = MULTIMODAL_REGISTRY.create_processor(tiny_llava_dir)
    inputs = processor.dummy_inputs.get_dummy_processor_inputs(4096, {"image": 3})
    assert inputs.prompt_text == "<image>" * 3
    assert [im.size for im in inputs.mm_data["image"]] == [(32, 32)] * 3


def test_builder_must_override_something(tiny_llava_dir):
    class Incomplete(BaseDummyInputsBuilder):
        pass

    builder = Incomplete(MULTIMODAL_REGISTRY.create_processor(tiny_llava_dir).info)
    with pytest.raises(NotImplementedError, match="get_dummy_processor_inputs"):
        builder.get_dummy_text({"image": 1})
