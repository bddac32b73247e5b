"""mm_processor_kwargs on their way to the HF processor: the constructor gets the keys it names, the call
the keys it takes, the rest is dropped with one warning; processors are cached per constructor kwargs and
the processor-output cache keys on the merged kwargs. Expected outputs come from the HF processors built
and called with the same kwargs, and token counts from the tiny checkpoints' geometry."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoProcessor, BatchFeature, LlavaProcessor
from transformers.image_utils import SizeDict

from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal import context as context_module
from tessera.multimodal.context import split_mm_kwargs
from testkit import random_images

PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
IMAGE_SIZE, PATCH_SIZE = 32, 8  # the tiny LLaVA's CLIP geometry (testkit/checkpoints.py)
LOGGER = "tessera.multimodal.context"
make = MULTIMODAL_REGISTRY.create_processor


def context(folder, **config_kwargs):
    return make(folder, mm_processor_cache_gb=0, mm_processor_kwargs=config_kwargs).info.ctx


def image_token_count(ids, processor) -> int:
    return int((ids == processor.tokenizer.convert_tokens_to_ids("<image>")).sum())


@pytest.fixture(scope="module")
def image():
    return random_images([(40, 30)], seed=11)


def call(ctx, images, request_kwargs=None):
    """What processing.py's default _call_hf_processor does: the processor built with the request's
    kwargs, called with them (the context merges the configured ones into both)."""
    request_kwargs = request_kwargs or {}
    processor = ctx.get_hf_processor(**request_kwargs)
    return processor, ctx.call_hf_processor(processor, {"text": PROMPT, "images": images}, request_kwargs)


# ---- constructor and call --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, features",
    [
        ({"vision_feature_select_strategy": "default"}, (IMAGE_SIZE // PATCH_SIZE) ** 2),  # CLS dropped
        ({"vision_feature_select_strategy": "full"}, (IMAGE_SIZE // PATCH_SIZE) ** 2 + 1),  # CLS kept
        ({"patch_size": 16}, (IMAGE_SIZE // 16) ** 2),
    ],
)
def test_config_kwargs_reach_the_constructor_as_from_pretrained_takes_them(tiny_llava_dir, image, kwargs, features):
    processor, ours = call(context(tiny_llava_dir, **kwargs), image)
    hf = LlavaProcessor.from_pretrained(tiny_llava_dir, **kwargs)(text=PROMPT, images=image, return_tensors="pt")
    assert ours["input_ids"].tolist() == hf["input_ids"].tolist()
    assert image_token_count(ours["input_ids"], processor) == features
    assert torch.equal(ours["pixel_values"], hf["pixel_values"])


def test_a_key_both_take_goes_to_both_as_vllm(tiny_llava_dir, image, monkeypatch):
    loads = []
    original = context_module.AutoProcessor.from_pretrained

    def recording(*args, **kwargs):
        loads.append({k: v for k, v in kwargs.items() if k not in ("tokenizer", "trust_remote_code")})
        return original(*args, **kwargs)

    monkeypatch.setattr(context_module.AutoProcessor, "from_pretrained", recording)
    config = {"vision_feature_select_strategy": "full", "do_normalize": False, "padding": False}
    processor, ours = call(context(tiny_llava_dir, **config), image)
    # vision_feature_select_strategy: only LlavaProcessor's __init__ names it; do_normalize: the image processor's
    # __init__ and the call both take it (vLLM passes it to both); padding: a call (text) option only
    assert loads == [{}, {"vision_feature_select_strategy": "full", "do_normalize": False}]
    assert processor.vision_feature_select_strategy == "full"
    assert processor.image_processor.do_normalize is False
    assert split_mm_kwargs(processor, config).call == {"do_normalize": False, "padding": False}
    monkeypatch.undo()
    hf_processor = AutoProcessor.from_pretrained(tiny_llava_dir, vision_feature_select_strategy="full")
    hf = hf_processor(text=PROMPT, images=image, do_normalize=False, return_tensors="pt")
    normalized = hf_processor(text=PROMPT, images=image, return_tensors="pt")
    assert ours["input_ids"].tolist() == hf["input_ids"].tolist()
    assert torch.equal(ours["pixel_values"], hf["pixel_values"])
    assert not torch.equal(ours["pixel_values"], normalized["pixel_values"])


def test_a_request_overrides_the_config_key_by_key(tiny_llava_dir, image):
    ctx = context(tiny_llava_dir, vision_feature_select_strategy="full", do_normalize=False)
    processor, ours = call(ctx, image, {"do_normalize": True})
    hf = AutoProcessor.from_pretrained(tiny_llava_dir, vision_feature_select_strategy="full")(
        text=PROMPT, images=image, return_tensors="pt"
    )
    assert processor.vision_feature_select_strategy == "full"  # from the config
    assert torch.equal(ours["pixel_values"], hf["pixel_values"])  # normalized: the request's value
    assert ours["input_ids"].tolist() == hf["input_ids"].tolist()


def test_fuyu_patch_size_from_the_config_changes_the_layout_as_hf(tiny_fuyu_dir, image):
    """Fuyu's patch size belongs to its image processor: from_pretrained routes it there, and the
    model's prompt updates (which read the image processor) follow, cached or not."""
    patch = SizeDict(height=16, width=16)  # transformers 5 checks the type: a plain dict is refused
    hf_processor = AutoProcessor.from_pretrained(tiny_fuyu_dir, patch_size=patch)
    hf_ids = hf_processor(text="Hi", images=image, return_tensors="pt")["input_ids"][0].tolist()
    width, height = image[0].size
    rows, columns = math.ceil(height / patch.height), math.ceil(width / patch.width)
    speaker, newline = (hf_processor.tokenizer.convert_tokens_to_ids(t) for t in ("|SPEAKER|", "|NEWLINE|"))
    assert (hf_ids.count(speaker), hf_ids.count(newline)) == (rows * columns, rows)
    for cache_gb in (0, 1):
        as_json = {"height": 16, "width": 16}  # as a CLI or server user writes it: we make it a SizeDict
        processor = make(tiny_fuyu_dir, mm_processor_cache_gb=cache_gb, mm_processor_kwargs={"patch_size": as_json})
        out = processor.apply("Hi", {"image": image})
        assert out["prompt_token_ids"] == hf_ids
        (placeholder,) = out["mm_placeholders"]["image"]
        assert placeholder.get_num_embeds() == rows * columns  # one embedding per patch


# ---- what nothing takes ------------------------------------------------------------------------------


def test_unknown_keys_are_refused_naming_them_and_the_options(tiny_llava_dir, image):
    processor = make(tiny_llava_dir, mm_processor_cache_gb=0)
    plain = processor.apply(PROMPT, {"image": image})
    refused = ({"bogus": 2}, {"do_normalise": False, "do_resize": True}, {"text": "x"}, {"return_tensors": "np"})
    for request_kwargs in refused:
        with pytest.raises(ValueError, match="not an option") as error:
            processor.apply(PROMPT, {"image": image}, request_kwargs)
        message = str(error.value)
        bad = next(k for k in request_kwargs if k != "do_resize")
        assert repr(bad) in message and "LlavaProcessor" in message
        assert "do_normalize" in message and "vision_feature_select_strategy" in message  # what it takes
    with pytest.raises(ValueError, match="did you mean 'do_normalize'"):
        processor.apply(PROMPT, {"image": image}, {"do_normalise": False})
    # a refused request leaves nothing behind: the next one is processed as before
    assert processor.apply(PROMPT, {"image": image})["prompt_token_ids"] == plain["prompt_token_ids"]
    misconfigured = make(tiny_llava_dir, mm_processor_kwargs={"not_an_option": 1})
    with pytest.raises(ValueError, match=r"\['not_an_option'\] is not an option"):
        misconfigured.check_mm_kwargs()
    with pytest.raises(ValueError, match="'not_an_option'"):
        misconfigured.apply(PROMPT, {"image": image})


def test_the_inputs_own_names_and_return_tensors_never_reach_the_call(tiny_llava_dir, image):
    """They used to crash the call ("got multiple values"); a model's own call leaves them out."""
    _, plain = call(context(tiny_llava_dir), image)
    _, out = call(context(tiny_llava_dir), image, {"text": "other", "images": [], "return_tensors": "np"})
    assert isinstance(out["input_ids"], torch.Tensor)
    assert out["input_ids"].tolist() == plain["input_ids"].tolist()


def test_a_processor_with_a_strict_signature_gets_only_what_it_names(tiny_llava_dir):
    """A custom processor without **kwargs would raise TypeError on an extra key."""
    seen = {}

    def strict(*, text, images=None, return_tensors=None, scale=1):
        seen.update(text=text, scale=scale)
        return BatchFeature({"input_ids": torch.tensor([[1, 2]])})

    def loose(text, return_tensors=None, **kwargs):
        seen.update(kwargs)
        return BatchFeature({"input_ids": torch.tensor([[1]])})

    ctx = context(tiny_llava_dir)
    ctx.call_hf_processor(strict, {"text": "hi"}, {"scale": 3, "colour": "red"})
    assert seen == {"text": "hi", "scale": 3}
    ctx.call_hf_processor(loose, {"text": "hi"}, {"colour": "red"})
    assert seen["colour"] == "red"  # **kwargs takes anything, as in vLLM


def test_the_split_of_llava_kwargs(tiny_llava_dir):
    processor = context(tiny_llava_dir).get_hf_processor()
    split = split_mm_kwargs(
        processor,
        {"patch_size": 8, "do_resize": True, "images_kwargs": {}, "padding": True, "tokenizer": 1, "size_x": 2},
    )
    assert split.constructor == {"patch_size": 8, "do_resize": True}  # LlavaProcessor's, CLIPImageProcessor's
    assert split.call == {"do_resize": True, "images_kwargs": {}, "padding": True}
    assert sorted(split.dropped) == ["size_x", "tokenizer"]


def test_keys_a_processor_class_defaults_at_call_time_go_to_the_call(tmp_path):
    # Gemma3Processor's class attribute images_kwargs = {"do_pan_and_scan": False, ...} overrides at call time
    # what its image processor was constructed with: given to the constructor alone, the option would be ignored.
    from testkit.gemma3 import build_tiny_gemma3

    processor = AutoProcessor.from_pretrained(build_tiny_gemma3(tmp_path / "gemma3"))
    assert processor.images_kwargs["do_pan_and_scan"] is False  # the class default this is about
    split = split_mm_kwargs(processor, {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 2})
    assert split.call == {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 2}  # (the constructor's too, as vLLM)


def test_call_settings_layer_the_class_defaults_and_the_kwargs(tmp_path):
    from testkit.gemma3 import build_tiny_gemma3

    folder = build_tiny_gemma3(tmp_path / "gemma3")
    keys, base = (
        ("do_pan_and_scan", "pan_and_scan_max_num_crops"),
        {"do_pan_and_scan": None, "pan_and_scan_max_num_crops": 7},
    )
    # Gemma3Processor's class attribute images_kwargs sets both: it wins over the sub-processor's values
    defaults = AutoProcessor.from_pretrained(folder).images_kwargs
    assert context(folder).get_call_settings(keys, base) == {k: defaults[k] for k in keys}
    model_level = context(folder, do_pan_and_scan=True)  # the model's mm_processor_kwargs, then the request's
    assert model_level.get_call_settings(keys, base)["do_pan_and_scan"] is True
    request = {"images_kwargs": {"pan_and_scan_max_num_crops": 2}, "do_pan_and_scan": False}
    assert model_level.get_call_settings(keys, base, request) == {
        "do_pan_and_scan": False,
        "pan_and_scan_max_num_crops": 2,
    }


def test_use_fast_goes_to_from_pretrained(tiny_llava_dir):
    assert split_mm_kwargs(context(tiny_llava_dir).get_hf_processor(), {"use_fast": True}).constructor == {
        "use_fast": True
    }
    ours = context(tiny_llava_dir, use_fast=True).get_hf_processor()
    assert type(ours.image_processor) is type(
        AutoProcessor.from_pretrained(tiny_llava_dir, use_fast=True).image_processor
    )


# ---- processor instances --------------------------------------------------------------------------------


def test_processors_are_cached_per_constructor_kwargs(tiny_llava_dir, monkeypatch):
    loads = []
    original = context_module.AutoProcessor.from_pretrained
    monkeypatch.setattr(
        context_module.AutoProcessor,
        "from_pretrained",
        lambda *a, **kw: loads.append(kw) or original(*a, **kw),
    )
    monkeypatch.setattr(context_module, "MAX_CACHED_PROCESSORS", 2)
    ctx = context(tiny_llava_dir)
    base = ctx.get_hf_processor()
    assert ctx.get_hf_processor(padding=True) is base  # a call option only: no new instance
    assert ctx.get_hf_processor(bogus=1) is base
    full = ctx.get_hf_processor(vision_feature_select_strategy="full")
    assert full is not base and full.vision_feature_select_strategy == "full"
    assert ctx.get_hf_processor(vision_feature_select_strategy="full", padding=True) is full
    both = ctx.get_hf_processor(patch_size=4, vision_feature_select_strategy="full")
    assert ctx.get_hf_processor(vision_feature_select_strategy="full", patch_size=4) is both  # order-blind
    assert len(loads) == 3  # base, full, both
    ctx.get_hf_processor(patch_size=2)  # a third set: the least recently used ("full") goes
    assert ctx.get_hf_processor(patch_size=4, vision_feature_select_strategy="full") is both
    assert ctx.get_hf_processor(vision_feature_select_strategy="full") is not full
    assert len(loads) == 5


def test_a_constructor_value_the_processor_cannot_take_is_a_value_error(tiny_llava_dir):
    ctx = context(tiny_llava_dir, vision_feature_select_strategy="full")
    assert ctx.get_hf_processor().vision_feature_select_strategy == "full"
    with pytest.raises(ValueError, match="patch_size"):
        call(ctx, random_images([(40, 30)]), {"patch_size": "eight"})


# ---- the processor-output cache -------------------------------------------------------------------------


def test_the_processor_cache_keys_on_the_merged_kwargs(tiny_llava_dir, image, monkeypatch):
    processor = make(tiny_llava_dir)  # cache on
    ctx = processor.info.ctx
    image_calls = []
    original = ctx.call_hf_processor

    def counting(hf_processor, data, kwargs={}):
        if data.get("images"):
            image_calls.append(dict(kwargs))
        return original(hf_processor, data, kwargs)

    monkeypatch.setattr(ctx, "call_hf_processor", counting)
    first = processor.apply(PROMPT, {"image": image}, {"do_normalize": False})
    again = processor.apply(PROMPT, {"image": image}, {"do_normalize": False})
    assert len(image_calls) == 1  # the same kwargs: a hit
    assert again["mm_hashes"] == first["mm_hashes"]
    other = processor.apply(PROMPT, {"image": image}, {"do_normalize": True})
    assert len(image_calls) == 2 and other["mm_hashes"] != first["mm_hashes"]  # other kwargs: another entry
    pixels = [out["mm_kwargs"].get_item("image", 0)["pixel_values"].data for out in (first, again, other)]
    hf = AutoProcessor.from_pretrained(tiny_llava_dir)
    assert torch.equal(
        pixels[0], hf(text=PROMPT, images=image, do_normalize=False, return_tensors="pt")["pixel_values"][0]
    )
    assert torch.equal(pixels[1], pixels[0])
    assert torch.equal(pixels[2], hf(text=PROMPT, images=image, return_tensors="pt")["pixel_values"][0])
    # the same kwargs set in the config instead of the request: the same entry
    configured = make(tiny_llava_dir, mm_processor_kwargs={"do_normalize": False}).apply(PROMPT, {"image": image})
    assert configured["mm_hashes"] == first["mm_hashes"]
