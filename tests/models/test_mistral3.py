"""Mistral 3 VLM (Pixtral vision) against Hugging Face transformers on a tiny checkpoint (fp32): the
processor's outputs (images wide, tall, tiny, larger than the longest edge, two per prompt), prefill
logits, and greedy tokens alone, batched, with chunked prefill (a chunk boundary inside an image),
prefix caching and preemption; the vision tower and projector alone against HF's for several images
of different sizes in one call and other vision feature layers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor, Mistral3Config
from transformers import Mistral3ForConditionalGeneration as HFMistral3

from tessera import LLM, SamplingParams
from tessera.models.loader import load_tensors
from tessera.models.mistral3 import Mistral3ForConditionalGeneration
from tessera.multimodal import MULTIMODAL_REGISTRY
from testkit import random_images
from testkit.generation import (
    ENGINE_CASES,
    assert_chunk_boundary_inside_an_item,
    assert_engine_case_happened,
    engine_case_options,
    greedy_logprobs,
)
from testkit.mistral3 import IMG, IMG_BREAK, IMG_END, LONGEST_EDGE, MERGE, PATCH, build_tiny_mistral3

TEXT = "What is in the image? Describe the image."
PROMPTS = [  # (prompt, image sizes (width, height))
    ("Describe the image.[IMG]What colour is the circle?", [(40, 30)]),
    ("[IMG] and\n[IMG]Compare them. What is in the image?", [(100, 30), (30, 70)]),
]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CHUNK = 8


def request(i: int):
    prompt, sizes = PROMPTS[i]
    return {"prompt": prompt, "multi_modal_data": {"image": random_images(sizes, seed=i)}}


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    """(folder, HF model, HF processor, [(HF inputs, HF greedy tokens) per PROMPTS entry])."""
    folder = build_tiny_mistral3(tmp_path_factory.mktemp("tiny_mistral3"))
    hf_model = HFMistral3.from_pretrained(folder, attn_implementation="eager").eval()
    hf_processor = AutoProcessor.from_pretrained(folder)
    runs = []
    for i, (prompt, sizes) in enumerate(PROMPTS):
        inputs = hf_processor(text=prompt, images=random_images(sizes, seed=i), return_tensors="pt")
        with torch.no_grad():
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
        runs.append((inputs, out[0, inputs["input_ids"].shape[1] :].tolist()))
    return folder, hf_model, hf_processor, runs


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("cache_gb", [0, 1])
@pytest.mark.parametrize(
    "sizes",
    [[(7, 9)], [(48, 48)], [(200, 30)], [(30, 200)], [(333, 250)], [(60, 40), (30, 200)], [(40, 30), (16, 16)]],
    ids=["tiny", "square", "wide", "tall", "large", "two-wide-tall", "two-small"],
)
def test_processor_matches_hf(mistral3, sizes, cache_gb):
    folder, _, hf_processor, _ = mistral3
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    prompt = "Look:" + " and\n".join([IMG] * len(sizes)) + "What is it?"
    images = random_images(sizes)
    hf = hf_processor(text=prompt, images=images, return_tensors="pt")
    img, brk, end = hf_processor.tokenizer.convert_tokens_to_ids([IMG, IMG_BREAK, IMG_END])
    for _ in range(2):  # the second call hits the processor cache when there is one
        out = processor.apply(prompt, {"image": images})
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        items = out["mm_kwargs"].get_items("image")
        assert len(items) == len(images)
        for item, padded, (h, w) in zip(items, hf["pixel_values"], hf["image_sizes"].tolist()):
            assert item["image_sizes"].data.tolist() == [h, w]
            torch.testing.assert_close(item["pixel_values"].data, padded[:, :h, :w])  # HF pads to the largest
        placeholders = out["mm_placeholders"]["image"]
        assert len(placeholders) == len(images)
        for placeholder, image in zip(placeholders, images):
            span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
            assert torch.equal(torch.as_tensor(placeholder.is_embed), span.eq(img))
            assert span[-1] == end and span[0] == img
            count = processor.info.get_num_image_tokens(image_width=image.size[0], image_height=image.size[1])
            assert count == int(span.eq(img).sum())
            rows = int(span.eq(brk).sum()) + 1
            assert count % rows == 0 and len(span) == rows * (count // rows + 1)
        assert sum(int(torch.as_tensor(p.is_embed).sum()) for p in placeholders) == int(hf["input_ids"].eq(img).sum())
    if sizes == [(200, 30)]:  # resized to 48x7, rounded up to 48x8: one row of six tokens, no break
        assert hf["image_sizes"].tolist() == [[8, 48]]
        assert int(hf["input_ids"].eq(brk).sum()) == 0


def test_prefill_logits_match_hf(mistral3):
    folder, hf_model, _, runs = mistral3
    inputs, _ = runs[1]
    with torch.no_grad():
        want = hf_model(**inputs).logits[0, -1].log_softmax(-1)
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB", enable_prefix_caching=False,
              limit_mm_per_prompt={"image": 2})  # fmt: skip
    ((_, logprobs),) = greedy_logprobs(llm, [request(1)], 1, want.shape[0])
    torch.testing.assert_close(logprobs[0], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", ENGINE_CASES)
def test_greedy_tokens_match_hf_alone_and_batched(mistral3, options):
    folder, hf_model, hf_processor, runs = mistral3
    want = [tokens_ for _, tokens_ in runs]
    lens = [inputs["input_ids"].shape[1] for inputs, _ in runs]
    lens.append(len(hf_processor.tokenizer.encode(TEXT)))  # the image prompts and the text one start together
    kwargs = engine_case_options(options, text_config=hf_model.config.text_config, prompt_lens=lens, chunk=CHUNK)
    llm = LLM(str(folder), device="cpu", block_size=4,
              **{"kv_cache_memory": "4MiB", "limit_mm_per_prompt": {"image": 2}, **kwargs})  # fmt: skip
    if options == "chunked-prefill":
        assert_chunk_boundary_inside_an_item(llm, request(0), "image", CHUNK)
    assert [tokens(llm, [request(i)])[0] for i in range(len(PROMPTS))] == want
    hits = llm.engine.core.block_manager.prefix_hits
    assert tokens(llm, [request(0), TEXT, request(1)])[::2] == want  # batched
    assert_engine_case_happened(llm, options, hits)


@pytest.mark.parametrize("feature_layers", [-1, -2, 0])
def test_image_features_match_hf(mistral3, feature_layers):
    """Tower and projector alone, in memory: three images of different shapes in one call (HF pads them
    to one tensor and masks attention block-diagonally), features of the last, the one before and
    the tower's input layer (HF's hidden_states[0]: ln_pre's output)."""
    folder, hf_model, hf_processor, _ = mistral3
    config = Mistral3Config.from_pretrained(folder)
    config.vision_feature_layer = feature_layers
    if feature_layers == -1:
        hf = hf_model
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            hf = HFMistral3(config).eval()
            with torch.no_grad():
                for param in hf.parameters():
                    param.normal_(0, 0.2)
    model = Mistral3ForConditionalGeneration(config)
    load_tensors(model, hf.state_dict().items(), "memory", described_by="HF's model")
    inputs = hf_processor(text=IMG * 3, images=random_images([(40, 30), (7, 9), (30, 100)]), return_tensors="pt")
    with torch.no_grad():
        # all hidden states captured: HF captures none when the selection is layer 0 (falsy)
        want = hf.model.get_image_features(
            inputs["pixel_values"], inputs["image_sizes"], output_hidden_states=True
        ).pooler_output
        got = model.get_multimodal_embeddings(
            pixel_values=list(inputs["pixel_values"]), image_sizes=inputs["image_sizes"]
        )
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    step = PATCH * MERGE
    assert [g.shape[0] for g in got] == [(h // step) * (w // step) for h, w in inputs["image_sizes"].tolist()]
    assert max(inputs["image_sizes"].flatten().tolist()) <= LONGEST_EDGE


@pytest.mark.parametrize("tie", [False, True])
def test_head_tied_by_the_outer_config(mistral3, tie):
    """HF 5 ties lm_head to the embeddings by Mistral3Config.tie_word_embeddings (default True), whatever
    the text config says."""
    config = Mistral3Config.from_pretrained(mistral3[0])
    config.tie_word_embeddings = tie
    assert config.text_config.tie_word_embeddings is False
    lm = Mistral3ForConditionalGeneration(config).language_model
    assert (lm.lm_head.weight is lm.model.embed_tokens.weight) == tie
    assert config.text_config.tie_word_embeddings is False  # the caller's config is left as it was
