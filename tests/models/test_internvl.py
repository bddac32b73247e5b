"""InternVL 3 (HF format) against Hugging Face transformers on a tiny checkpoint (fp32): the processor's
outputs (several image sizes: tiled with a thumbnail, a single tile; two images per prompt; tiling kwargs;
videos, alone and with images), prefill logits, and greedy tokens alone, batched, with chunked prefill (a
chunk boundary inside an image, whose embeddings are split across the chunks), prefix caching and
preemption, for images and a video; the vision tower alone in both norm variants (RMSNorm + qk-norm)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import InternVLForConditionalGeneration as HFInternVL
from transformers import InternVLVisionModel as HFInternVLVision

from tessera import LLM, SamplingParams
from tessera.models.internvl_vision import InternVLVisionModel
from tessera.models.loader import load_tensors
from tessera.multimodal import MULTIMODAL_REGISTRY
from testkit import random_images, random_video
from testkit.generation import (
    ENGINE_CASES,
    assert_chunk_boundary_inside_an_item,
    assert_engine_case_happened,
    engine_case_options,
    greedy_logprobs,
)
from testkit.internvl import (
    IMAGE_SEQ_LENGTH,
    IMG_CONTEXT,
    IMG_END,
    IMG_START,
    MAX_PATCHES,
    VIDEO,
    build_tiny_internvl,
    internvl_tokenizer,
    tiny_internvl_config,
)

TEXT = "What is in the image? Describe the image."
PROMPTS = [  # (prompt, image sizes (width, height), video frames or 0)
    ("Describe the image.<IMG_CONTEXT>What colour is the circle?", [(100, 30)], 0),
    ("<IMG_CONTEXT> and\n<IMG_CONTEXT>Compare them. What is in the image?", [(60, 40), (30, 70)], 0),
    ("Watch<video>What happens in the video?", [], 3),
]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CHUNK = 8


def mm_data(i: int) -> dict:
    _, sizes, frames = PROMPTS[i]
    data = {"image": random_images(sizes, seed=i)} if sizes else {}
    if frames:
        data["video"] = [random_video(frames, 40, 30, seed=i)]
    return data


def hf_inputs(hf_processor, i: int):
    data = mm_data(i)
    return hf_processor(text=PROMPTS[i][0], images=data.get("image"), videos=data.get("video"), return_tensors="pt")


def request(i: int):
    return {"prompt": PROMPTS[i][0], "multi_modal_data": mm_data(i)}


@pytest.fixture(scope="module")
def internvl(tmp_path_factory):
    """(folder, HF model, HF processor, [(HF inputs, HF greedy tokens) per PROMPTS entry])."""
    folder = build_tiny_internvl(tmp_path_factory.mktemp("tiny_internvl"))
    hf_model = HFInternVL.from_pretrained(folder, attn_implementation="eager").eval()
    hf_processor = AutoProcessor.from_pretrained(folder)
    runs = []
    for i in range(len(PROMPTS)):
        inputs = hf_inputs(hf_processor, i)
        with torch.no_grad():
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
        runs.append((inputs, out[0, inputs["input_ids"].shape[1] :].tolist()))
    return folder, hf_model, hf_processor, runs


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("cache_gb", [0, 1])
@pytest.mark.parametrize(
    "kwargs", [{}, {"max_patches": 2}, {"crop_to_patches": False}], ids=["default", "max2", "no-crop"]
)
@pytest.mark.parametrize(
    "sizes", [[(7, 9)], [(32, 32)], [(100, 30)], [(30, 200)], [(60, 40), (30, 70)], [(64, 64), (16, 16)]]
)
def test_processor_matches_hf(internvl, sizes, kwargs, cache_gb):
    folder, _, hf_processor, _ = internvl
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    prompt = "Look:" + " and\n".join([IMG_CONTEXT] * len(sizes)) + "What is it?"
    images = random_images(sizes)
    hf = hf_processor(text=prompt, images=images, return_tensors="pt", **kwargs)
    context = hf_processor.image_token_id
    start_id, end_id = hf_processor.tokenizer.convert_tokens_to_ids([IMG_START, IMG_END])
    for _ in range(2):  # the second call hits the processor cache when there is one
        out = processor.apply(prompt, {"image": images}, kwargs)
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        items = out["mm_kwargs"].get_items("image")
        torch.testing.assert_close(torch.cat([i["pixel_values"].data for i in items]), hf["pixel_values"])
        placeholders = out["mm_placeholders"]["image"]
        assert len(placeholders) == len(images)
        for placeholder, image in zip(placeholders, images):
            span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
            assert torch.equal(torch.as_tensor(placeholder.is_embed), span.eq(context))
            assert span[0] == start_id and span[-1] == end_id
            count = processor.info.get_num_image_tokens(
                image_width=image.size[0], image_height=image.size[1], mm_kwargs=kwargs
            )
            assert count == int(span.eq(context).sum())
            patches = hf_processor.image_processor.get_number_of_image_patches(
                image.size[1], image.size[0], {"crop_to_patches": True, **kwargs}
            )
            assert count == patches * IMAGE_SEQ_LENGTH
    if sizes == [(100, 30)] and not kwargs:  # 3x1 tiles and the thumbnail
        assert hf["pixel_values"].shape[0] == 4
    if sizes == [(32, 32)] or "crop_to_patches" in kwargs:  # one tile, no thumbnail
        assert hf["pixel_values"].shape[0] == len(sizes)


def test_max_tokens_per_item(internvl):
    folder, _, _, _ = internvl
    processor = MULTIMODAL_REGISTRY.create_processor(folder)
    assert processor.info.get_max_image_tokens() == (MAX_PATCHES + 1) * IMAGE_SEQ_LENGTH
    frame = IMG_START + IMG_CONTEXT * IMAGE_SEQ_LENGTH + IMG_END
    video = "\n".join(f"Frame{i + 1}: {frame}" for i in range(8))  # HF's text for the profiling video (8 frames)
    video_tokens = len(processor.info.get_tokenizer().encode(video, add_special_tokens=False))
    assert processor.info.get_mm_max_tokens_per_item(1024, {"image": 1}) == {
        "image": (MAX_PATCHES + 1) * IMAGE_SEQ_LENGTH + 2,
        "video": video_tokens,
    }


@pytest.mark.parametrize("cache_gb", [0, 1])
@pytest.mark.parametrize(
    "prompt,sizes,frames",
    [
        ("Look<video>What is it?", [], [3]),
        ("Look <video> and\n<video>", [], [2, 2]),
        ("A<IMG_CONTEXT>then<video>and<IMG_CONTEXT>.", [(100, 30), (20, 20)], [2]),
        ("<video>first, then<IMG_CONTEXT>", [(30, 70)], [1]),
    ],
)
def test_video_processor_matches_hf(internvl, prompt, sizes, frames, cache_gb):
    folder, _, hf_processor, _ = internvl
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    images = random_images(sizes)
    videos = [random_video(n, 40 + 8 * k, 30, seed=k) for k, n in enumerate(frames)]
    hf = hf_processor(text=prompt, images=images or None, videos=videos, return_tensors="pt")
    context = hf_processor.image_token_id
    start_id, end_id = hf_processor.tokenizer.convert_tokens_to_ids([IMG_START, IMG_END])
    data = {"video": videos, **({"image": images} if images else {})}
    for _ in range(2):
        out = processor.apply(prompt, data)
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        # HF puts the images' tiles and the videos' frames in prompt order into one pixel_values
        order = [VIDEO if token == VIDEO else IMG_CONTEXT for token in _media_in_order(prompt)]
        image_items = iter(out["mm_kwargs"].get_items("image")) if images else iter(())
        video_items = iter(out["mm_kwargs"].get_items("video"))
        pixels = [
            next(video_items)["pixel_values_videos"].data if kind == VIDEO else next(image_items)["pixel_values"].data
            for kind in order
        ]
        torch.testing.assert_close(torch.cat(pixels), hf["pixel_values"])
        placeholders = out["mm_placeholders"]["video"]
        for placeholder, n in zip(placeholders, frames):
            span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
            assert torch.equal(torch.as_tensor(placeholder.is_embed), span.eq(context))
            assert span[0] == start_id and span[-1] == end_id
            assert int(span.eq(context).sum()) == n * IMAGE_SEQ_LENGTH
        spans = [p for ps in out["mm_placeholders"].values() for p in ps]
        assert sum(int(torch.as_tensor(p.is_embed).sum()) for p in spans) == int(hf["input_ids"].eq(context).sum())


def _media_in_order(prompt: str) -> list[str]:
    return [
        t
        for t in prompt.replace(VIDEO, "\0" + VIDEO + "\0").replace(IMG_CONTEXT, "\0" + IMG_CONTEXT + "\0").split("\0")
        if t in (VIDEO, IMG_CONTEXT)
    ]


@pytest.mark.parametrize("i", [1, 2], ids=["images", "video"])
def test_prefill_logits_match_hf(internvl, i):
    folder, hf_model, _, runs = internvl
    inputs, _ = runs[i]
    with torch.no_grad():
        want = hf_model(**inputs).logits[0, -1].log_softmax(-1)
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB", enable_prefix_caching=False,
              limit_mm_per_prompt={"image": 2, "video": 1})  # fmt: skip
    ((_, logprobs),) = greedy_logprobs(llm, [request(i)], 1, want.shape[0])
    torch.testing.assert_close(logprobs[0], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", ENGINE_CASES)
def test_greedy_tokens_match_hf_alone_and_batched(internvl, options):
    folder, hf_model, hf_processor, runs = internvl
    want = [tokens_ for _, tokens_ in runs]
    lens = [inputs["input_ids"].shape[1] for inputs, _ in runs]
    lens.append(len(hf_processor.tokenizer.encode(TEXT)))  # the media prompts and the text one start together
    kwargs = engine_case_options(options, text_config=hf_model.config.text_config, prompt_lens=lens, chunk=CHUNK)
    llm = LLM(str(folder), device="cpu", block_size=4,
              **{"kv_cache_memory": "4MiB", "limit_mm_per_prompt": {"image": 2, "video": 1}, **kwargs})  # fmt: skip
    if options == "chunked-prefill":
        assert_chunk_boundary_inside_an_item(llm, request(0), "image", CHUNK)
    assert [tokens(llm, [request(i)])[0] for i in range(len(PROMPTS))] == want
    hits = llm.engine.core.block_manager.prefix_hits
    batched = tokens(llm, [request(0), TEXT, request(1), request(2)])
    assert batched[:1] + batched[2:] == want
    assert_engine_case_happened(llm, options, hits)


@pytest.mark.parametrize("variant", ["layer_norm", "rms_qk"])
@pytest.mark.parametrize("feature_layer", [-1, 1])
def test_vision_tower_matches_hf(variant, feature_layer):
    """The tower alone, both norm variants (RMSNorm with qk-norm as the larger InternViTs), from HF's weights."""
    vision_config = tiny_internvl_config(internvl_tokenizer(), vision_variant=variant).vision_config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = HFInternVLVision(vision_config).eval()
        with torch.no_grad():
            for param in hf.parameters():
                param.normal_(0, 0.2)
    ours = InternVLVisionModel(vision_config)
    load_tensors(ours, hf.state_dict().items(), "HF InternVLVisionModel")
    pixel_values = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        out = hf(pixel_values, output_hidden_states=True)
        want = out.last_hidden_state if feature_layer == -1 else out.hidden_states[feature_layer]
        torch.testing.assert_close(ours(pixel_values, feature_layer), want, atol=1e-5, rtol=1e-5)


def test_loads_transformers_in_memory_layout(internvl):
    """transformers 5 saves the top-level layout (loaded above); its in-memory one nests the parts under
    "model." and has lm_head at the top: both load to the same weights."""
    from tessera.models.internvl import InternVLForConditionalGeneration

    _, hf_model, _, _ = internvl
    ours = InternVLForConditionalGeneration(hf_model.config)
    names = list(hf_model.state_dict())
    assert any(n.startswith("model.vision_tower.") for n in names) and "lm_head.weight" in names
    load_tensors(ours, hf_model.state_dict().items(), "HF InternVLForConditionalGeneration")
    hf_layer = hf_model.model.vision_tower.encoder.layer[1]
    torch.testing.assert_close(ours.vision_tower.encoder.layer[1].lambda_2, hf_layer.lambda_2)
    torch.testing.assert_close(
        ours.vision_tower.encoder.layer[1].attention.qkv_proj.weight[32:64], hf_layer.attention.k_proj.weight
    )
    torch.testing.assert_close(ours.language_model.lm_head.weight, hf_model.lm_head.weight)
