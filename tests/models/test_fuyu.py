"""Fuyu model code against Hugging Face transformers on the tiny checkpoint (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import FuyuForCausalLM as HFFuyu

from tessera.config import ModelConfig
from tessera.models.loader import load_model
from tessera.multimodal import MULTIMODAL_REGISTRY
from tests.models.runner import Runner, Sequence
from tests.multimodal.test_processing import random_images

PROMPT = "What colour is the square?"
SIZES = [(60, 40), (48, 48), (20, 90)]  # (width, height): cropped, exact and downscaled grids


@pytest.fixture(scope="module")
def fuyu(tiny_fuyu_dir):
    return (
        load_model(ModelConfig(str(tiny_fuyu_dir), device="cpu")),
        HFFuyu.from_pretrained(tiny_fuyu_dir, attn_implementation="eager").eval(),
        MULTIMODAL_REGISTRY.create_processor(tiny_fuyu_dir),
        AutoProcessor.from_pretrained(tiny_fuyu_dir),
    )


def hf_inputs(hf_processor, processor, image):
    if image is None:  # text only: HF's processor only tokenizes; feed HF the same token ids as ours
        return {"input_ids": torch.tensor([processor.apply(PROMPT, {})["prompt_token_ids"]])}
    return hf_processor(text=PROMPT, images=[image], return_tensors="pt")


@pytest.mark.parametrize("size", [None, SIZES[0]], ids=["text-only", "one-image"])
def test_prefill_logits_match_hf(fuyu, size):
    model, hf_model, processor, hf_processor = fuyu
    image = random_images([size])[0] if size else None
    with torch.no_grad():
        expected = hf_model(**hf_inputs(hf_processor, processor, image)).logits[0]
    ours = Runner(model).prefill([Sequence(processor.apply(PROMPT, {"image": image}))])[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_three_images_of_different_sizes_in_one_batch_match_hf(fuyu):
    """Fuyu takes one image per prompt (as HF's processor and vLLM): three prompts, one forward."""
    model, hf_model, processor, hf_processor = fuyu
    images = random_images(SIZES, seed=5)
    ours = Runner(model).prefill([Sequence(processor.apply(PROMPT, {"image": image})) for image in images])
    for image, logits in zip(images, ours):
        with torch.no_grad():
            expected = hf_model(**hf_inputs(hf_processor, processor, image)).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("size", [None, SIZES[2]], ids=["text-only", "one-image"])
def test_greedy_tokens_match_hf_generate(fuyu, size):
    model, hf_model, processor, hf_processor = fuyu
    image = random_images([size], seed=9)[0] if size else None
    inputs = hf_inputs(hf_processor, processor, image)
    with torch.no_grad():
        hf_out = hf_model.generate(**inputs, max_new_tokens=16, do_sample=False, eos_token_id=None)
    expected = hf_out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(expected) == 16
    assert Runner(model).greedy(Sequence(processor.apply(PROMPT, {"image": image})), 16) == expected


def test_paged_decode_equals_recomputing_the_sequence(fuyu):
    model, _, processor, _ = fuyu
    inputs = processor.apply(PROMPT, {"image": random_images([(33, 47)])})
    tokens, decode_logits = Runner(model, block_size=5).greedy_with_logits(Sequence(inputs), 8)
    full = Sequence(inputs)
    full.token_ids += tokens[:-1]
    recomputed = Runner(model).prefill([full])[0]
    torch.testing.assert_close(decode_logits, recomputed[len(inputs["prompt_token_ids"]) :], atol=1e-5, rtol=0)


def test_merging_by_token_id_needs_the_image_token_id(fuyu, tiny_fuyu_dir):
    model, _, processor, _ = fuyu
    inputs = processor.apply(PROMPT, {"image": random_images([(16, 16)])})
    ids = torch.tensor(inputs["prompt_token_ids"])
    embeds = model.get_multimodal_embeddings(**inputs["mm_kwargs"])
    with pytest.raises(ValueError, match="placeholder_token_id"):
        model.get_input_embeddings(ids, embeds)
    model.placeholder_token_id = processor.info.get_tokenizer().convert_tokens_to_ids("|SPEAKER|")
    try:
        by_id = model.get_input_embeddings(ids, embeds)
    finally:
        model.placeholder_token_id = None
    mask = torch.zeros(len(ids), dtype=torch.bool)
    (placeholder,) = inputs["mm_placeholders"]["image"]
    mask[placeholder.offset : placeholder.offset + placeholder.length] = placeholder.is_embed
    torch.testing.assert_close(by_id, model.get_input_embeddings(ids, embeds, is_multimodal=mask))


def test_batch_of_four_equals_each_alone(fuyu):
    model, _, processor, _ = fuyu
    requests = [
        ("Hi", None),
        (PROMPT, (60, 40)),
        ("Where is the red circle in this picture?", (20, 90)),
        ("Count.", None),
    ]
    inputs = [processor.apply(text, {"image": random_images([size])[0] if size else None}) for text, size in requests]
    together = Runner(model).prefill([Sequence(x) for x in inputs])
    for x, batched in zip(inputs, together):
        torch.testing.assert_close(batched, Runner(model).prefill([Sequence(x)])[0], atol=1e-5, rtol=0)
