"""Which mm_processor_kwargs a processor takes and where each goes (vLLM's rule, its own tests ported),
options HF still takes under deprecation (Qwen-VL's min_pixels / max_pixels), the start-up profile sized
by the effective settings, and the bounds on what a request's numbers may ask for. Expected outputs come
from the HF processors called with the same options, and token counts from the tiny checkpoints' geometry."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import AutoProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from tessera.config import ModelConfig, MultiModalConfig
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.context import InputProcessingContext
from tessera.multimodal.processor_options import (
    MAX_REQUEST_PIXELS,
    MAX_REQUEST_SIDE,
    check_request_magnitudes,
    processor_options,
    split_mm_kwargs,
)
from tessera.multimodal.profiling import MultiModalProfiler
from testkit import random_images
from testkit.qwen_vl import MERGE_SIZE, PATCH_SIZE, build_tiny_qwen2_5_vl

QWEN_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>Describe it."
FACTOR = PATCH_SIZE * MERGE_SIZE  # pixels per side of one merged token


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def picture():
    return random_images([(320, 240)], seed=5)


def qwen_hf(folder, images, **kwargs):
    with warnings.catch_warnings():  # "passing min_pixels / max_pixels to a call is deprecated"
        warnings.simplefilter("ignore", FutureWarning)
        return AutoProcessor.from_pretrained(folder)(text=QWEN_PROMPT, images=images, return_tensors="pt", **kwargs)


# ---- vLLM's tests of the constructor and call kwargs, ported -------------------------------------------


class DummyProcessor:
    """A processor class of another kind than transformers' (vLLM's test double)."""

    def __init__(self, a: int = 0, b: int = 0) -> None:
        self.a = a
        self.b = b

    def __call__(self, a: int = 0, c: int = 0, return_tensors: str | None = None) -> dict[str, int]:
        return dict(a=a, c=c)


def dummy_context(folder, config_kwargs) -> InputProcessingContext:
    mm_config = MultiModalConfig(mm_processor_kwargs=config_kwargs)
    return InputProcessingContext(ModelConfig(str(folder), multimodal_config=mm_config))


@pytest.mark.parametrize(
    "config_kwargs, inference_kwargs, expected",
    [
        ({"a": 1}, {}, {"a": 1, "b": 0}),
        ({}, {"a": 1}, {"a": 1, "b": 0}),
        ({"a": 1}, {"a": 2}, {"a": 2, "b": 0}),  # the request's value wins
        ({"a": 1, "c": 1}, {}, {"a": 1, "b": 0}),  # c is the call's, not the constructor's
        ({"b": 1, "c": 1}, {}, {"a": 0, "b": 1}),
    ],
)
def test_hf_processor_init_kwargs(tiny_llava_dir, config_kwargs, inference_kwargs, expected):
    processor = dummy_context(tiny_llava_dir, config_kwargs).get_hf_processor(DummyProcessor, **inference_kwargs)
    assert isinstance(processor, DummyProcessor)
    assert {"a": processor.a, "b": processor.b} == expected


@pytest.mark.parametrize(
    "config_kwargs, inference_kwargs, expected",
    [
        ({"a": 1}, {}, {"a": 1, "c": 0}),
        ({}, {"a": 1}, {"a": 1, "c": 0}),
        ({"a": 1}, {"a": 2}, {"a": 2, "c": 0}),
        ({"a": 1, "c": 1}, {}, {"a": 1, "c": 1}),  # a: the constructor's and the call's, given to both
        ({"b": 1, "c": 1}, {}, {"a": 0, "c": 1}),
    ],
)
def test_hf_processor_call_kwargs(tiny_llava_dir, config_kwargs, inference_kwargs, expected):
    ctx = dummy_context(tiny_llava_dir, config_kwargs)
    processor = ctx.get_hf_processor(DummyProcessor)
    assert ctx.call_hf_processor(processor, {}, inference_kwargs) == expected


def test_a_processor_of_another_kind_is_cached_per_constructor_kwargs(tiny_llava_dir):
    ctx = dummy_context(tiny_llava_dir, {})
    first = ctx.get_hf_processor(DummyProcessor, a=1, c=5)
    assert ctx.get_hf_processor(DummyProcessor, a=1, c=6) is first  # c is no constructor option
    assert ctx.get_hf_processor(DummyProcessor, a=2) is not first
    options = processor_options(first)
    assert options.constructor == {"a", "b"} and options.call == {"a", "c", "return_tensors"}
    assert split_mm_kwargs(first, {"a": 1, "b": 2, "c": 3, "d": 4}) == ({"a": 1, "b": 2}, {"a": 1, "c": 3}, ["d"])


# ---- options HF takes under deprecation ----------------------------------------------------------------


def test_qwen_max_pixels_reaches_the_processor_as_hf_takes_it(qwen_dir, picture):
    """Qwen-VL's model cards cap image tokens with max_pixels: HF 5.23 takes it in the image processor's
    constructor and (deprecated) in the call; it must not be dropped."""
    processor = MULTIMODAL_REGISTRY.create_processor(qwen_dir, mm_processor_cache_gb=0)
    image_pad = processor.info.get_tokenizer().convert_tokens_to_ids("<|image_pad|>")
    for kwargs in ({"max_pixels": FACTOR**2 * 6}, {"size": {"shortest_edge": FACTOR**2, "longest_edge": FACTOR**2 * 4}},
                   {"min_pixels": FACTOR**2 * 5, "max_pixels": FACTOR**2 * 6},
                   {"images_kwargs": {"max_pixels": FACTOR**2 * 2}}):  # fmt: skip
        hf = qwen_hf(qwen_dir, picture, **kwargs)
        assert hf["input_ids"].tolist() != qwen_hf(qwen_dir, picture)["input_ids"].tolist()  # the option counts
        ours = processor.apply(QWEN_PROMPT, {"image": picture}, kwargs)
        assert ours["prompt_token_ids"] == hf["input_ids"][0].tolist()
        (item,) = ours["mm_kwargs"].get_items("image")
        assert torch.equal(item["pixel_values"].data, hf["pixel_values"])
        assert ours["mm_placeholders"]["image"][0].length == int((hf["input_ids"] == image_pad).sum())
    split = split_mm_kwargs(processor.info.get_hf_processor(), {"max_pixels": 1, "min_pixels": 2})
    assert split.constructor == split.call == {"max_pixels": 1, "min_pixels": 2}  # both take them, as vLLM


def test_the_profile_plans_for_the_pictures_the_settings_give(qwen_dir):
    """The start-up profile used to read max_pixels that the processor then ignored: budgets were planned for
    pictures smaller than those that arrived. Now both follow the model-level setting."""
    for max_blocks in (3, 7):
        kwargs = {"max_pixels": FACTOR**2 * max_blocks}
        processor = MULTIMODAL_REGISTRY.create_processor(qwen_dir, mm_processor_kwargs=kwargs)
        max_image = MultiModalProfiler(processor).get_mm_max_tokens_per_item(1024)["image"]
        assert max_image == max_blocks  # the most merged tokens max_pixels allows (a 1 x N grid at worst)
        for size in ((640, 480), (300, 700), (900, 200)):
            (image,) = random_images([size], seed=1)
            out = processor.apply(QWEN_PROMPT, {"image": image})
            height, width = smart_resize(size[1], size[0], FACTOR, 256, FACTOR**2 * max_blocks)
            assert out["mm_placeholders"]["image"][0].length == (height // FACTOR) * (width // FACTOR) <= max_image


# ---- what a request's numbers may ask for ---------------------------------------------------------------


def test_request_numbers_are_bounded_on_the_scale_of_the_option(qwen_dir, tiny_llava_dir):
    qwen = AutoProcessor.from_pretrained(qwen_dir)
    llava = AutoProcessor.from_pretrained(tiny_llava_dir)
    # pixel counts: named so (max_pixels), or Qwen's size edges, which the processor itself holds over 8192
    check_request_magnitudes(qwen, {"max_pixels": 12845056, "size": {"longest_edge": 12845056}})
    check_request_magnitudes(qwen, {"images_kwargs": {"min_pixels": MAX_REQUEST_PIXELS}})
    check_request_magnitudes(llava, {"size": {"shortest_edge": MAX_REQUEST_SIDE}, "crop_size": [64, 64]})
    refused = [
        (qwen, {"min_pixels": MAX_REQUEST_PIXELS + 1}, "mm_processor_kwargs.min_pixels="),
        (qwen, {"size": {"longest_edge": 10**12}}, "mm_processor_kwargs.size.longest_edge="),
        (llava, {"size": {"shortest_edge": 50000}}, "mm_processor_kwargs.size.shortest_edge=50000 is over 8192"),
        (llava, {"crop_size": [64, 10**9]}, "mm_processor_kwargs.crop_size[1]="),
        (llava, {"rescale_factor": float("nan")}, "rescale_factor=nan"),
    ]
    for processor, kwargs, message in refused:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            check_request_magnitudes(processor, kwargs)


def test_a_request_over_the_bounds_is_refused_before_any_processing(qwen_dir, picture, monkeypatch):
    processor = MULTIMODAL_REGISTRY.create_processor(qwen_dir)
    calls = []
    monkeypatch.setattr(processor.info.ctx, "call_hf_processor", lambda *a, **k: calls.append(a))
    with pytest.raises(ValueError, match="over"):
        processor.apply(QWEN_PROMPT, {"image": picture}, {"min_pixels": 10**12})
    assert calls == []
    # the model's own settings are the operator's: not bounded
    configured = MULTIMODAL_REGISTRY.create_processor(qwen_dir, mm_processor_kwargs={"max_pixels": 10**9})
    configured.check_mm_kwargs()
    assert math.isfinite(configured.info.get_num_image_tokens(image_width=64, image_height=64))


# ---- the case the issue was filed on: Qwen2.5-VL-3B-Instruct's published processor files ---------------

PUBLISHED_QWEN2_5_VL = {  # Qwen/Qwen2.5-VL-3B-Instruct's preprocessor_config.json
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}  # fmt: skip


def test_max_pixels_caps_a_published_qwen_checkpoint_as_its_model_card_says(qwen_dir, tmp_path):
    """LLM(model, mm_processor_kwargs={"max_pixels": 313600}) on Qwen2.5-VL-3B's processor files turned a
    1280x960 picture into 1593 prompt tokens (the option dropped) where HF gives a few hundred, and the
    start-up profile planned for the capped size. Model level and per request, both now follow HF."""
    import json
    import shutil

    folder = tmp_path / "published"
    shutil.copytree(qwen_dir, folder)
    (folder / "processor_config.json").unlink()
    (folder / "preprocessor_config.json").write_text(json.dumps(PUBLISHED_QWEN2_5_VL))
    (picture,) = random_images([(1280, 960)], seed=2)
    capped = {"max_pixels": 313600}
    hf = qwen_hf(folder, picture, **capped)
    image_pad = AutoProcessor.from_pretrained(folder).tokenizer.convert_tokens_to_ids("<|image_pad|>")
    height, width = smart_resize(960, 1280, 28, 3136, 313600)
    assert int((hf["input_ids"] == image_pad).sum()) == (height // 28) * (width // 28)
    model_level = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_kwargs=capped)
    per_request = MULTIMODAL_REGISTRY.create_processor(folder)
    for processor, kwargs in ((model_level, {}), (per_request, capped)):
        out = processor.apply(QWEN_PROMPT, {"image": picture}, kwargs)
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
    uncapped = per_request.apply(QWEN_PROMPT, {"image": picture})
    assert uncapped["prompt_token_ids"] == qwen_hf(folder, picture)["input_ids"][0].tolist()
    height, width = smart_resize(960, 1280, 28, 3136, 12845056)  # the checkpoint's own bounds
    assert uncapped["mm_placeholders"]["image"][0].length == (height // 28) * (width // 28)
    profiled = MultiModalProfiler(model_level).get_mm_max_tokens_per_item(32768)["image"]
    assert profiled == 313600 // 28**2  # 400: the most tokens the capped processor gives any picture
