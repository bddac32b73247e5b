"""MULTIMODAL_REGISTRY: processors found from config.json, out-of-tree models, guide-written files."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from tessera import ModelRegistry
from tessera.models.llava import LlavaForConditionalGeneration, LlavaMultiModalProcessor
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.processing import DEFAULT_MM_LIMIT


def clone_with_architecture(src, dst, architecture):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = [architecture]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def image(width, height, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_processor_is_chosen_by_config_architecture(tiny_llava_dir, tiny_fuyu_dir):
    from tessera.models.fuyu import FuyuMultiModalProcessor

    assert isinstance(MULTIMODAL_REGISTRY.create_processor(tiny_llava_dir), LlavaMultiModalProcessor)
    assert isinstance(MULTIMODAL_REGISTRY.create_processor(tiny_fuyu_dir), FuyuMultiModalProcessor)


def test_unknown_architecture_lists_the_supported_ones(tiny_llava_dir, tmp_path):
    folder = clone_with_architecture(tiny_llava_dir, tmp_path / "m", "NoSuchModel")
    with pytest.raises(ValueError, match=r"\['NoSuchModel'\] are not supported.*LlavaForConditionalGeneration"):
        MULTIMODAL_REGISTRY.create_processor(folder)


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        MULTIMODAL_REGISTRY.create_processor(tmp_path)


def test_model_without_processor_is_a_clear_error(tiny_llava_dir, tmp_path):
    class TextOnlyModel:
        pass

    ModelRegistry.register_model("TestTextOnlyModel", TextOnlyModel)
    folder = clone_with_architecture(tiny_llava_dir, tmp_path / "m", "TestTextOnlyModel")
    with pytest.raises(ValueError, match="has no multimodal processor"):
        MULTIMODAL_REGISTRY.create_processor(folder)


def test_out_of_tree_subclass_inherits_the_processor(tiny_llava_dir, tmp_path):
    class MyLlava(LlavaForConditionalGeneration):
        pass

    ModelRegistry.register_model("TestMyLlava", MyLlava)
    folder = clone_with_architecture(tiny_llava_dir, tmp_path / "m", "TestMyLlava")
    assert isinstance(MULTIMODAL_REGISTRY.create_processor(folder), LlavaMultiModalProcessor)


@pytest.mark.parametrize(
    "fixture, user_limit, expected",
    [
        ("tiny_llava_dir", None, DEFAULT_MM_LIMIT),
        ("tiny_llava_dir", 2, 2),
        ("tiny_fuyu_dir", 5, 1),
        ("tiny_fuyu_dir", 0, 0),
    ],
)
def test_allowed_limit_is_min_of_model_and_user(request, fixture, user_limit, expected):
    limits = None if user_limit is None else {"image": user_limit}
    processor = MULTIMODAL_REGISTRY.create_processor(request.getfixturevalue(fixture), limit_mm_per_prompt=limits)
    assert processor.info.get_allowed_mm_limits() == {"image": expected}


def test_cache_size_option(tiny_llava_dir):
    assert MULTIMODAL_REGISTRY.create_processor(tiny_llava_dir, mm_processor_cache_gb=0).cache is None
    processor = MULTIMODAL_REGISTRY.create_processor(tiny_llava_dir, mm_processor_cache_gb=0.25)
    assert processor.cache.capacity_bytes == (1 << 30) // 4
    assert MULTIMODAL_REGISTRY.create_processor(tiny_llava_dir).cache.capacity_bytes == 1 << 30  # default 1 GiB


# ---- model files written by following vLLM's guide, ported by changing imports -------------------


@pytest.mark.parametrize("cache_gb", [0, 1.0])
def test_guide_llava_file_works_unchanged(tiny_llava_dir, tmp_path, cache_gb):
    from tests.multimodal.guide_port.llava_from_guide import (
        GuideLlavaForConditionalGeneration,
        GuideLlavaMultiModalProcessor,
    )

    ModelRegistry.register_model("GuideLlavaForConditionalGeneration", GuideLlavaForConditionalGeneration)
    folder = clone_with_architecture(tiny_llava_dir, tmp_path / "guide-llava", "GuideLlavaForConditionalGeneration")
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    assert isinstance(processor, GuideLlavaMultiModalProcessor)

    prompt = "USER: <image>\n<image>\nSame colour? ASSISTANT:"
    images = [image(40, 30), image(64, 64, seed=1)]
    hf = AutoProcessor.from_pretrained(tiny_llava_dir)(text=prompt, images=images, return_tensors="pt")
    for prompt_form in (prompt, processor.info.get_tokenizer().encode(prompt)):
        out = processor.apply(prompt_form, {"image": images})
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        assert (out["mm_kwargs"]["pixel_values"] == hf["pixel_values"]).all()


@pytest.mark.parametrize("cache_gb", [0, 1.0])
def test_guide_fuyu_file_works_unchanged(tiny_fuyu_dir, tmp_path, cache_gb):
    # Registered lazily by "module:Class", as plugins that avoid importing torch early do.
    ModelRegistry.register_model(
        "GuideFuyuForCausalLM", "tests.multimodal.guide_port.fuyu_from_guide:GuideFuyuForCausalLM"
    )
    folder = clone_with_architecture(tiny_fuyu_dir, tmp_path / "guide-fuyu", "GuideFuyuForCausalLM")
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    assert type(processor).__name__ == "GuideFuyuMultiModalProcessor"

    prompt = "Where is the triangle?"
    images = [image(90, 20)]
    hf = AutoProcessor.from_pretrained(tiny_fuyu_dir)(text=prompt, images=images, return_tensors="pt")
    for prompt_form in (prompt, processor.info.get_tokenizer().encode(prompt)):
        out = processor.apply(prompt_form, {"image": images})
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        hf_patches = hf["image_patches"]  # transformers 5: the prompt's patches, [patches, patch_dim]
        assert torch.equal(out["mm_kwargs"]["image_patches"].reshape(hf_patches.shape), hf_patches)
