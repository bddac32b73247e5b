"""LLaVA and Fuyu processing against the HF processors on the tiny checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.prompt_updates import PromptIndexTargets, PromptInsertion, PromptReplacement
from testkit import IMAGE_SIZES as SIZES
from testkit import LLAVA_PROMPTS, build_tiny_llava, random_images


@pytest.fixture(scope="module")
def llava_hf(tiny_llava_dir):
    return AutoProcessor.from_pretrained(tiny_llava_dir)


@pytest.fixture(scope="module")
def fuyu_hf(tiny_fuyu_dir):
    return AutoProcessor.from_pretrained(tiny_fuyu_dir)


def make(folder, **options):
    return MULTIMODAL_REGISTRY.create_processor(folder, **options)


def placeholders_as_tuples(out):
    return {
        m: [(p.offset, p.length, None if p.is_embed is None else p.is_embed.tolist()) for p in ranges]
        for m, ranges in out["mm_placeholders"].items()
    }


def assert_same_output(a, b):
    assert a["prompt_token_ids"] == b["prompt_token_ids"]
    assert placeholders_as_tuples(a) == placeholders_as_tuples(b)
    assert a["mm_kwargs"] == b["mm_kwargs"]
    assert a["mm_hashes"] == b["mm_hashes"]


# ---- LLaVA -------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_llava_text_prompt_matches_hf(tiny_llava_dir, llava_hf, num_images):
    images = random_images(SIZES[:num_images])
    prompt = LLAVA_PROMPTS[num_images]
    ours = make(tiny_llava_dir, mm_processor_cache_gb=0).apply(prompt, {"image": images})
    hf = llava_hf(text=prompt, images=images or None, return_tensors="pt")

    assert ours["prompt_token_ids"] == hf["input_ids"][0].tolist()
    if num_images:
        assert torch.equal(ours["mm_kwargs"]["pixel_values"], hf["pixel_values"])
    else:
        assert "pixel_values" not in ours["mm_kwargs"]


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_llava_placeholders_cover_each_run_of_image_tokens(tmp_path, strategy):
    folder = build_tiny_llava(tmp_path / strategy, vision_feature_select_strategy=strategy)
    processor = make(folder)
    image_token_id = processor.info.get_hf_config().image_token_index
    out = processor.apply(LLAVA_PROMPTS[3], {"image": random_images(SIZES)})

    ids = np.array(out["prompt_token_ids"])
    # First principles: CLIP 32px / 8px patches = 16 features, plus CLS with "full".
    expected_len = 16 + (strategy == "full")
    runs = np.flatnonzero(np.diff(np.r_[0, ids == image_token_id, 0]))  # [start, end, start, end, ...]
    assert [(int(s), int(e - s), None) for s, e in runs.reshape(-1, 2)] == [
        (p.offset, p.length, p.is_embed) for p in out["mm_placeholders"]["image"]
    ]
    assert all(p.length == expected_len for p in out["mm_placeholders"]["image"])


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_llava_token_prompt_equals_text_prompt(tiny_llava_dir, num_images):
    images = random_images(SIZES[:num_images])
    processor = make(tiny_llava_dir, mm_processor_cache_gb=0)
    prompt = LLAVA_PROMPTS[num_images]
    token_ids = processor.info.get_tokenizer().encode(prompt)
    assert_same_output(processor.apply(token_ids, {"image": images}), processor.apply(prompt, {"image": images}))


@pytest.mark.parametrize("as_tokens", [False, True])
@pytest.mark.parametrize("warm_indices", [[], [1, 3], [0, 1, 2, 3]], ids=["hit0", "hit0.5", "hit1"])
def test_llava_cached_equals_uncached_at_every_hit_rate(tiny_llava_dir, as_tokens, warm_indices):
    images = random_images(SIZES + [(20, 30)], seed=1)
    prompt = "USER: <image><image>\n<image>\n<image>\nDescribe. ASSISTANT:"
    uncached = make(tiny_llava_dir, mm_processor_cache_gb=0).apply(prompt, {"image": images})

    processor = make(tiny_llava_dir)
    for i in warm_indices:  # non-contiguous hits check that items are merged back in prompt order
        processor.apply("<image>", {"image": images[i]})
    if as_tokens:
        prompt = processor.info.get_tokenizer().encode(prompt)
    hits_before = processor.cache.stats.hits
    out = processor.apply(prompt, {"image": images})

    assert processor.cache.stats.hits - hits_before == len(warm_indices)
    assert_same_output(out, uncached)


@pytest.mark.parametrize("text_options", [{}, {"add_special_tokens": False}])
def test_text_sent_apart_from_its_items_is_tokenized_as_the_processor_call_does(tiny_llava_dir, llava_hf, text_options):
    """The processor-output cache sends text without its items (transformers 5 refuses the pair);
    the text still gets the options the processor's call merges, so cached equals HF."""
    (image,) = random_images([(40, 30)])
    prompt = LLAVA_PROMPTS[1]
    hf = llava_hf(text=prompt, images=[image], return_tensors="pt", **text_options)
    ours = make(tiny_llava_dir, mm_processor_cache_gb=1, mm_processor_kwargs=text_options).apply(
        prompt, {"image": [image]}
    )
    assert ours["prompt_token_ids"] == hf["input_ids"][0].tolist()
    assert (ours["prompt_token_ids"][0] == llava_hf.tokenizer.bos_token_id) == (not text_options)


def test_llava_image_types_give_identical_inputs(tiny_llava_dir):
    (image,) = random_images([(48, 36)])
    array = np.asarray(image)
    tensor = torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()
    processor = make(tiny_llava_dir, mm_processor_cache_gb=0)
    outs = [processor.apply(LLAVA_PROMPTS[1], {"image": x}) for x in (image, array, tensor, [image])]
    for out in outs[1:]:
        assert out["prompt_token_ids"] == outs[0]["prompt_token_ids"]
        assert torch.equal(out["mm_kwargs"]["pixel_values"], outs[0]["mm_kwargs"]["pixel_values"])


def test_llava_precomputed_embeddings_skip_hf_and_cache(tiny_llava_dir):
    processor = make(tiny_llava_dir)
    embeds = torch.randn(3, 5, 32)  # 3 images of 5 features each
    out = processor.apply(LLAVA_PROMPTS[3], {"image_embeds": embeds})
    image_token_id = processor.info.get_hf_config().image_token_index

    assert [p.length for p in out["mm_placeholders"]["image"]] == [5, 5, 5]
    assert out["prompt_token_ids"].count(image_token_id) == 15
    assert torch.equal(out["mm_kwargs"]["image_embeds"], embeds)
    assert "pixel_values" not in out["mm_kwargs"]
    assert len(processor.cache) == 0 and processor.cache.stats.queries == 0


# ---- Fuyu --------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES + [(48, 48), (200, 30)])
def test_fuyu_text_prompt_matches_hf(tiny_fuyu_dir, fuyu_hf, size):
    (image,) = random_images([size])
    prompt = "What colour is the square?"
    ours = make(tiny_fuyu_dir, mm_processor_cache_gb=0).apply(prompt, {"image": [image]})
    hf = fuyu_hf(text=prompt, images=[image], return_tensors="pt")

    assert ours["prompt_token_ids"] == hf["input_ids"][0].tolist()
    hf_patches = hf["image_patches"]  # transformers 5: the prompt's patches, [patches, patch_dim]
    assert torch.equal(ours["mm_kwargs"]["image_patches"].reshape(hf_patches.shape), hf_patches)


@pytest.mark.parametrize("size", SIZES)
def test_fuyu_placeholder_is_the_patch_grid_then_bos(tiny_fuyu_dir, fuyu_hf, size):
    (image,) = random_images([size])
    out = make(tiny_fuyu_dir).apply("Describe the image.", {"image": image})
    tokenizer = fuyu_hf.tokenizer
    speaker, newline = tokenizer.convert_tokens_to_ids(["|SPEAKER|", "|NEWLINE|"])
    bos = tokenizer.convert_tokens_to_ids("<s>")
    (placeholder,) = out["mm_placeholders"]["image"]
    span = out["prompt_token_ids"][placeholder.offset : placeholder.offset + placeholder.length]

    num_patches = out["mm_kwargs"]["image_patches"].shape[1]
    rows = span.count(newline)
    assert placeholder.offset == 0
    assert span[-1] == bos and span.count(speaker) == num_patches
    assert span[:-1] == ([speaker] * (num_patches // rows) + [newline]) * rows
    assert placeholder.is_embed.tolist() == [t == speaker for t in span]
    assert placeholder.get_num_embeds() == num_patches


def test_fuyu_token_prompt_equals_text_prompt(tiny_fuyu_dir):
    processor = make(tiny_fuyu_dir, mm_processor_cache_gb=0)
    prompt = "How many shapes are there?"
    token_ids = processor.info.get_tokenizer().encode(prompt)
    for images in ([], random_images([(60, 40)])):
        assert_same_output(processor.apply(token_ids, {"image": images}), processor.apply(prompt, {"image": images}))


def test_fuyu_text_only_prompt_ends_with_beginning_of_answer(tiny_fuyu_dir, fuyu_hf):
    out = make(tiny_fuyu_dir).apply("Hello there", {})
    tokenizer = fuyu_hf.tokenizer
    expected = tokenizer("Hello there")["input_ids"] + [tokenizer.convert_tokens_to_ids("<0x04>")]
    assert out["prompt_token_ids"] == expected
    assert out["mm_placeholders"] == {}


def test_fuyu_cached_equals_uncached(tiny_fuyu_dir):
    image = random_images([(70, 30)], seed=3)
    prompt = "Where is the circle?"
    uncached = make(tiny_fuyu_dir, mm_processor_cache_gb=0).apply(prompt, {"image": image})
    processor = make(tiny_fuyu_dir)
    miss = processor.apply(prompt, {"image": image})
    hit = processor.apply(prompt, {"image": image})
    assert processor.cache.stats.hits == 1
    assert_same_output(miss, uncached)
    assert_same_output(hit, uncached)


# ---- errors ------------------------------------------------------------------------------------


def test_too_many_images(tiny_fuyu_dir, tiny_llava_dir):
    with pytest.raises(ValueError, match=r"At most 1 image\(s\) may be provided in one prompt\."):
        make(tiny_fuyu_dir).apply("Hi", {"image": random_images(SIZES[:2])})
    processor = make(tiny_llava_dir, limit_mm_per_prompt={"image": 2})
    with pytest.raises(ValueError, match=r"At most 2 image\(s\).*limit_mm_per_prompt"):
        processor.apply(LLAVA_PROMPTS[3], {"image": random_images(SIZES)})


def test_unsupported_modality(tiny_llava_dir):
    with pytest.raises(ValueError, match="does not support video inputs"):
        make(tiny_llava_dir).apply("Hi", {"video": [np.zeros((2, 8, 8, 3), np.uint8)]})


@pytest.mark.parametrize("cache_gb", [0, 1.0])
@pytest.mark.parametrize("as_tokens", [False, True])
@pytest.mark.parametrize(
    "prompt, num_images, found",
    [("USER: <image> hi", 2, 1), ("USER: <image><image><image> hi", 2, 3), ("USER: hi", 1, 0)],
)
def test_placeholder_count_mismatch_names_the_counts(tiny_llava_dir, cache_gb, as_tokens, prompt, num_images, found):
    processor = make(tiny_llava_dir, mm_processor_cache_gb=cache_gb)
    if as_tokens:
        prompt = processor.info.get_tokenizer().encode(prompt)
    with pytest.raises(ValueError, match=rf"{found} image placeholder\(s\) \('<image>'\) but {num_images} image"):
        processor.apply(prompt, {"image": random_images(SIZES[:num_images])})


@pytest.mark.parametrize(
    "bad, message",
    [
        ("photo.png", "unsupported type str"),
        (np.zeros((8, 8), np.uint8), "expected an HWC uint8 array"),
        (np.zeros((8, 8, 3), np.float32), "expected an HWC uint8 array"),
        (torch.zeros(8, 8), "expected a CHW tensor"),
    ],
)
def test_unreadable_image_objects(tiny_llava_dir, bad, message):
    with pytest.raises(ValueError, match=message):
        make(tiny_llava_dir).apply(LLAVA_PROMPTS[1], {"image": bad})


def test_truncated_image_file(tiny_llava_dir, tmp_path):
    path = tmp_path / "broken.png"
    random_images([(32, 32)])[0].save(path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="Image 0 could not be decoded"):
        make(tiny_llava_dir).apply(LLAVA_PROMPTS[1], {"image": Image.open(path)})


@pytest.mark.parametrize("cache_gb", [0, 1.0])
@pytest.mark.parametrize("as_tokens", [False, True])
@pytest.mark.parametrize(
    "prompt, num_images, missing",
    [("USER: <image> hi", 2, r"image item 1 \(counting from 0\) has none"), ("USER: hi", 2, r"image items 0 to 1")],
)
def test_placeholder_count_mismatch_names_the_missing_item(
    tiny_llava_dir, cache_gb, as_tokens, prompt, num_images, missing
):
    processor = make(tiny_llava_dir, mm_processor_cache_gb=cache_gb)
    if as_tokens:
        prompt = processor.info.get_tokenizer().encode(prompt)
    with pytest.raises(ValueError, match=missing):
        processor.apply(prompt, {"image": random_images(SIZES[:num_images])})


# ---- prompt updates other than LLaVA's own, through the whole processor -------------------------


def with_updates(processor, make_updates):
    """Swap the model's updates for `make_updates(replacement)`, keeping its per-item content."""
    original = processor._get_prompt_updates

    def get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs):
        (update,) = original(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)
        return make_updates(update.replacement)

    processor._get_prompt_updates = get_prompt_updates
    return processor


@pytest.mark.parametrize("cache_gb", [0, 1.0])
@pytest.mark.parametrize("as_tokens", [False, True])
@pytest.mark.parametrize(
    "make_updates",
    [
        # vLLM: an insertion puts every item after the first match; so does a replacement at an index.
        lambda content: [PromptInsertion("image", "ASSISTANT:", content)],
        lambda content: [PromptReplacement("image", PromptIndexTargets.end(), content)],
    ],
    ids=["insert-after-first-match", "replace-at-end"],
)
def test_every_item_goes_to_one_position(tiny_llava_dir, cache_gb, as_tokens, make_updates):
    processor = with_updates(make(tiny_llava_dir, mm_processor_cache_gb=cache_gb), make_updates)
    tokenizer = processor.info.get_tokenizer()
    image_token_id = processor.info.get_hf_config().image_token_index
    text = "USER: What is in the picture? ASSISTANT:"  # no <image>: the HF processor expands nothing
    prompt = tokenizer.encode(text) if as_tokens else text
    out = processor.apply(prompt, {"image": random_images(SIZES[:2])})

    text_ids = tokenizer.encode(text)
    assert out["prompt_token_ids"] == text_ids + [image_token_id] * 32  # "ASSISTANT:" ends the prompt
    assert placeholders_as_tuples(out) == {"image": [(len(text_ids), 16, None), (len(text_ids) + 16, 16, None)]}


def test_an_hf_expansion_longer_than_the_models_update_is_refused(tiny_llava_dir):
    """Per-request kwargs can make the HF processor expand an image to 17 tokens ("full" keeps the
    CLS token) while the model's update, from its config ("default"), gives 16: one image token
    would be left as text. vLLM goes on with that prompt; Tessera refuses it."""
    hf_full = AutoProcessor.from_pretrained(tiny_llava_dir, vision_feature_select_strategy="full")
    image = random_images([(40, 30)], seed=1)
    prompt = "USER: <image>\nHi ASSISTANT:"
    expanded = hf_full(text=prompt, images=image, return_tensors="pt")["input_ids"][0].tolist()
    image_token = hf_full.tokenizer.convert_tokens_to_ids("<image>")
    model_tokens = make(tiny_llava_dir, mm_processor_cache_gb=0).apply(prompt, {"image": image})
    assert expanded.count(image_token) == model_tokens["prompt_token_ids"].count(image_token) + 1
    processor = make(tiny_llava_dir, mm_processor_cache_gb=0)
    with pytest.raises(ValueError, match=r"expanded image item 0 .* to more tokens than the model's prompt update"):
        processor.apply(prompt, {"image": image}, {"vision_feature_select_strategy": "full"})
