"""Fuyu model code against Hugging Face transformers on the tiny checkpoint (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import FuyuForCausalLM as HFFuyu

from tessera import LLM, SamplingParams
from tessera.config import ModelConfig
from tessera.models.loader import load_model
from tessera.multimodal import MULTIMODAL_REGISTRY
from testkit import random_images
from testkit.generation import greedy_logprobs, hf_recomputed_logprobs

PROMPT = "What colour is the square?"
SIZES = [(60, 40), (48, 48), (20, 90)]  # (width, height): cropped, exact and downscaled grids


def engine(folder, **options) -> LLM:
    """The engine on the CPU with 4-token blocks (every prompt spans several) and no prefix caching
    (every prompt is computed)."""
    defaults = {"device": "cpu", "block_size": 4, "kv_cache_memory": "16MiB", "enable_prefix_caching": False}
    return LLM(str(folder), **{**defaults, **options})


def request(prompt, image):
    return prompt if image is None else {"prompt": prompt, "multi_modal_data": {"image": image}}


@pytest.fixture(scope="module")
def fuyu(tiny_fuyu_dir):
    return (
        engine(tiny_fuyu_dir),
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
    """The distribution after the prompt: from the last prompt position's logits, the only ones the
    engine computes."""
    llm, hf_model, processor, hf_processor = fuyu
    image = random_images([size])[0] if size else None
    with torch.no_grad():
        expected = hf_model(**hf_inputs(hf_processor, processor, image)).logits[0, -1].log_softmax(-1)
    ((_, ours),) = greedy_logprobs(llm, [request(PROMPT, image)], 1, hf_model.config.get_text_config().vocab_size)
    torch.testing.assert_close(ours[0], expected, atol=1e-4, rtol=0)


def test_three_images_of_different_sizes_in_one_batch_match_hf(fuyu):
    """Fuyu takes one image per prompt (as HF's processor and vLLM): three prompts, one step."""
    llm, hf_model, processor, hf_processor = fuyu
    images = random_images(SIZES, seed=5)
    vocab_size = hf_model.config.get_text_config().vocab_size
    ours = greedy_logprobs(llm, [request(PROMPT, image) for image in images], 1, vocab_size)
    for image, (_, logprobs) in zip(images, ours):
        with torch.no_grad():
            expected = hf_model(**hf_inputs(hf_processor, processor, image)).logits[0, -1].log_softmax(-1)
        torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("size", [None, SIZES[2]], ids=["text-only", "one-image"])
def test_greedy_tokens_match_hf_generate(fuyu, size):
    llm, hf_model, processor, hf_processor = fuyu
    image = random_images([size], seed=9)[0] if size else None
    inputs = hf_inputs(hf_processor, processor, image)
    with torch.no_grad():
        hf_out = hf_model.generate(**inputs, max_new_tokens=16, do_sample=False, eos_token_id=None)
    expected = hf_out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(expected) == 16
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate(request(PROMPT, image), params, use_tqdm=False)
    assert output.outputs[0].token_ids == expected


def test_paged_decode_equals_recomputing_the_sequence(fuyu, tiny_fuyu_dir):
    _, hf_model, processor, hf_processor = fuyu
    vocab_size = hf_model.config.get_text_config().vocab_size
    (image,) = random_images([(33, 47)])
    prompt = request(PROMPT, image)
    ((tokens, logprobs),) = greedy_logprobs(engine(tiny_fuyu_dir, block_size=5), [prompt], 8, vocab_size)
    ((_, one_block),) = greedy_logprobs(engine(tiny_fuyu_dir, block_size=128), [prompt], 8, vocab_size)
    torch.testing.assert_close(logprobs, one_block, atol=1e-5, rtol=0)

    # Recomputed: the prompt and every output token but the last in one forward (HF, no KV cache).
    recomputed = hf_recomputed_logprobs(hf_model, hf_inputs(hf_processor, processor, image), tokens)
    torch.testing.assert_close(logprobs, recomputed, atol=1e-4, rtol=0)


def test_merging_by_token_id_equals_merging_by_mask(fuyu, tiny_fuyu_dir):
    """The config's image_token_id (the |SPEAKER| id) merges as the placeholders' is_embed mask does;
    without it, merging by id is refused by name."""
    _, _, processor, _ = fuyu
    model = load_model(ModelConfig(str(tiny_fuyu_dir), device="cpu"))
    inputs = processor.apply(PROMPT, {"image": random_images([(16, 16)])})
    ids = torch.tensor(inputs["prompt_token_ids"])
    embeds = model.get_multimodal_embeddings(**inputs["mm_kwargs"])
    assert model.placeholder_token_id == processor.info.get_tokenizer().convert_tokens_to_ids("|SPEAKER|")
    by_id = model.get_input_embeddings(ids, embeds)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    (placeholder,) = inputs["mm_placeholders"]["image"]
    mask[placeholder.offset : placeholder.offset + placeholder.length] = placeholder.is_embed
    torch.testing.assert_close(by_id, model.get_input_embeddings(ids, embeds, is_multimodal=mask))
    model.placeholder_token_id = None
    with pytest.raises(ValueError, match="placeholder_token_id"):
        model.get_input_embeddings(ids, embeds)


def test_batch_of_four_equals_each_alone(fuyu):
    """The four prompts are prefilled in one step (they fit its token budget), then decoded together."""
    llm, hf_model, _, _ = fuyu
    requests = [
        ("Hi", None),
        (PROMPT, (60, 40)),
        ("Where is the red circle in this picture?", (20, 90)),
        ("Count.", None),
    ]
    prompts = [request(text, random_images([size])[0] if size else None) for text, size in requests]
    vocab_size = hf_model.config.get_text_config().vocab_size
    together = greedy_logprobs(llm, prompts, 4, vocab_size)
    for prompt, (tokens, logprobs) in zip(prompts, together):
        ((alone_tokens, alone_logprobs),) = greedy_logprobs(llm, [prompt], 4, vocab_size)
        assert tokens == alone_tokens
        torch.testing.assert_close(logprobs, alone_logprobs, atol=1e-5, rtol=0)
