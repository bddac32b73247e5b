"""LLaVA-OneVision against Hugging Face transformers on a tiny checkpoint (fp32): the SigLIP tower, the
processor's outputs and token counts (anyres_max_9 downscaling included) for images and videos, the
image and video features, prefill logits, and greedy tokens for image, video and image+video prompts,
alone, batched, with chunked prefill (chunks ending inside items), prefix caching and preemption."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from transformers import AutoProcessor, SiglipVisionConfig
from transformers import LlavaOnevisionForConditionalGeneration as HFLlavaOnevision
from transformers import SiglipVisionModel as HFSiglipVisionModel

from tessera import LLM, SamplingParams
from tessera.config import ModelConfig
from tessera.models.loader import load_model, load_tensors
from tessera.models.siglip import SiglipVisionModel
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.video import decode_video
from testkit import random_images, random_video, video_bytes
from testkit.generation import greedy_logprobs
from testkit.llava_next import build_tiny_llava_onevision


def user(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = [  # (prompt, image sizes (width, height), video (frames, width, height) or None)
    (user("What is in the picture?"), [], None),
    (user("<image>\nWhat colour is the circle?"), [(300, 250)], None),  # 4x4 tiles: downscaled
    (user("<image>\n<image> and <image>\nCompare them."), [(200, 30), (7, 9), (40, 30)], None),
    (user("<video>\nWhat happens?"), [], (4, 56, 40)),
    (user("<image>\n<video>\nCompare them."), [(60, 40)], (3, 30, 30)),
]
SIZES = [  # tiny, square (one tile), wide, tall, larger than the largest grid (128 px), downscaled, several
    [(7, 9)], [(32, 32)], [(200, 30)], [(30, 200)], [(500, 400)], [(128, 128)], [(60, 40), (33, 70), (100, 100)],
]  # fmt: skip
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
BLOCK = 4
LIMITS = {"image": 3, "video": 1}  # the most a prompt here has: a cheaper profile run


def data(i: int) -> dict:
    _, sizes, video = PROMPTS[i]
    out = {}
    if sizes:
        out["image"] = random_images(sizes, seed=i)
    if video:
        out["video"] = [random_video(*video, seed=i)]
    return out


def request(i: int):
    return {"prompt": PROMPTS[i][0], "multi_modal_data": data(i)} if data(i) else PROMPTS[i][0]


def hf_inputs(hf_processor, prompt, items):
    return hf_processor(text=prompt, images=items.get("image"), videos=items.get("video"), return_tensors="pt")


@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    """(folder, HF model, HF processor, HF's inputs and greedy tokens per PROMPTS entry)."""
    folder = build_tiny_llava_onevision(tmp_path_factory.mktemp("tiny_llava_onevision"))
    hf_model = HFLlavaOnevision.from_pretrained(folder, attn_implementation="eager").eval()
    hf_processor = AutoProcessor.from_pretrained(folder)
    inputs, expected = [], []
    for i, (prompt, _, _) in enumerate(PROMPTS):
        inputs.append(hf_inputs(hf_processor, prompt, data(i)))
        with torch.no_grad():
            out = hf_model.generate(**inputs[-1], max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
        expected.append(out[0, inputs[-1]["input_ids"].shape[1] :].tolist())
    return folder, hf_model, hf_processor, inputs, expected


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def hf_num_tokens(hf_processor, size) -> int:
    """HF's placeholder count for an image of `size` alone."""
    ids = hf_processor(text="<image>", images=random_images([size]), return_tensors="pt")["input_ids"]
    return int(ids.eq(hf_processor.image_token_id).sum())


def test_siglip_tower_matches_hf(tmp_path):
    """Hidden states at inner layers, and the last (post layer norm) with the pooling head."""
    config = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8
    )
    torch.manual_seed(0)
    hf = HFSiglipVisionModel(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.2)
    ours = SiglipVisionModel(config)
    load_tensors(ours, ((f"vision_model.{k}", v) for k, v in hf.state_dict().items()), "HF SiglipVisionModel")
    pixel_values = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = hf(pixel_values, output_hidden_states=True)
        states = ours(pixel_values, [0, -2, -1])
        last, pooled = ours(pixel_values)
    for state, i in zip(states, [0, -2, -1]):
        torch.testing.assert_close(state, expected.hidden_states[i], atol=1e-5, rtol=0)
    torch.testing.assert_close(last, expected.last_hidden_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(pooled, expected.pooler_output, atol=1e-5, rtol=0)


@pytest.mark.parametrize("cache_gb", [0, 1])
@pytest.mark.parametrize("sizes", SIZES)
def test_processor_matches_hf(onevision, sizes, cache_gb):
    folder, _, hf_processor, _, _ = onevision
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    prompt = user(" and ".join(["<image>"] * len(sizes)) + " What is it?")
    images = random_images(sizes)
    hf = hf_processor(text=prompt, images=images, return_tensors="pt")
    for _ in range(2):  # the second call hits the processor cache when there is one
        out = processor.apply(prompt, {"image": images})
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        items = out["mm_kwargs"].get_items("image")
        assert torch.stack([item["image_sizes"].data for item in items]).tolist() == hf["image_sizes"].tolist()
        for item, hf_pixels in zip(items, hf["pixel_values"]):
            pixels = item["pixel_values"].data  # the image's own tiles; HF pads to the call's most
            torch.testing.assert_close(pixels, hf_pixels[: len(pixels)], atol=0, rtol=0)
            assert not hf_pixels[len(pixels) :].any()
        for placeholder, size in zip(out["mm_placeholders"]["image"], sizes):
            span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
            assert span.eq(hf_processor.image_token_id).all()
            assert placeholder.length == hf_num_tokens(hf_processor, size)
    assert sum(p.length for p in out["mm_placeholders"]["image"]) == int(
        hf["input_ids"].eq(hf_processor.image_token_id).sum()
    )


def test_num_image_tokens_match_hf_for_every_grid(onevision):
    folder, _, hf_processor, _, _ = onevision
    info = MULTIMODAL_REGISTRY.create_processor(folder).info
    sizes = [size for group in SIZES for size in group] + [(w, h) for h, w in info.get_grid_pinpoints()]
    sizes += [(130, 90), (40, 128), (97, 64)]
    grids = set()
    for width, height in sizes:
        assert info.get_num_image_tokens(image_width=width, image_height=height) == hf_num_tokens(
            hf_processor, (width, height)
        ), (width, height)
        pixels = hf_processor.image_processor(images=random_images([(width, height)]), return_tensors="pt")
        grids.add(pixels["pixel_values"].shape[1])
    assert len(grids) >= 8  # the table picks many grids (tile counts)
    # the 4x4 grid's full image is downscaled: fewer tokens than its 16x16 features + newlines + base
    assert hf_num_tokens(hf_processor, (128, 128)) < 16 + 16 * 16 + 16
    # the largest count is no pinpoint's (a padded grid under the 10% margin beats a downscaled one)
    width, height = info.get_image_size_with_most_features()
    assert info.get_max_image_tokens() == hf_num_tokens(hf_processor, (width, height))
    assert all(info.get_max_image_tokens() >= hf_num_tokens(hf_processor, size) for size in sizes)
    assert info.get_max_image_tokens() > max(hf_num_tokens(hf_processor, (w, h)) for h, w in info.get_grid_pinpoints())


@pytest.fixture(scope="module")
def clip():
    """4 frames 32x32 encoded and decoded again (the media path's frames)."""
    return decode_video(video_bytes(num_frames=4, width=32, height=32, fps=4)).frames


@pytest.mark.parametrize("cache_gb", [0, 1])
@pytest.mark.parametrize("case", ["clip", "odd-frames", "image-and-video"])
def test_video_processor_matches_hf(onevision, clip, case, cache_gb):
    folder, _, hf_processor, _, _ = onevision
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    prompt, items = {
        "clip": (user("<video>\nWhat happens?"), {"video": [clip]}),
        "odd-frames": (user("<video>\nWhat happens?"), {"video": [random_video(3, 56, 40)]}),
        "image-and-video": (user("<image> and <video>"), {"image": random_images([(90, 30)]), "video": [clip]}),
    }[case]
    hf = hf_inputs(hf_processor, prompt, items)
    for _ in range(2):  # the second call hits the processor cache when there is one
        out = processor.apply(prompt, items)
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        (video,) = out["mm_kwargs"].get_items("video")
        torch.testing.assert_close(video["pixel_values_videos"].data, hf["pixel_values_videos"][0], atol=0, rtol=0)
        (placeholder,) = out["mm_placeholders"]["video"]
        assert placeholder.length == int(hf["input_ids"].eq(hf_processor.video_token_id).sum())
        span = hf["input_ids"][0, placeholder.offset : placeholder.offset + placeholder.length]
        assert span.eq(hf_processor.video_token_id).all()
    frames, height, width, _ = items["video"][0].shape
    num_tokens = processor.info.get_num_video_tokens(image_width=width, image_height=height, num_frames=frames)
    assert num_tokens == int(hf["input_ids"].eq(hf_processor.video_token_id).sum())


def test_max_video_tokens_is_what_the_dummy_video_gets(onevision):
    folder, _, hf_processor, _, _ = onevision
    processor = MULTIMODAL_REGISTRY.create_processor(folder)
    counts = {"image": 1, "video": 1}
    (video,) = processor.dummy_inputs.get_dummy_mm_data(4096, counts)["video"]
    ids = hf_inputs(hf_processor, "<video>", {"video": [video]})["input_ids"]
    assert processor.info.get_mm_max_tokens_per_item(4096, counts)["video"] == int(
        ids.eq(hf_processor.video_token_id).sum()
    )
    # a short sequence leaves room for fewer frames once the image is counted
    max_image = processor.info.get_max_image_tokens()
    assert processor.info.get_max_video_tokens(max_image + 2 * 4 + 1, counts) == 2 * 4 + 1


def test_image_and_video_features_match_hf(onevision, clip):
    folder, hf_model, hf_processor, _, _ = onevision
    model = load_model(ModelConfig(str(folder), device="cpu"))
    images = random_images([(200, 30), (7, 9), (30, 200), (500, 400)], seed=5)
    inputs = hf_processor.image_processor(images=images, return_tensors="pt")
    videos = hf_processor.video_processor(videos=[clip, random_video(4, 56, 40)], return_tensors="pt")
    with torch.no_grad():
        ours = model.get_multimodal_embeddings(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"])
        expected = hf_model.model.get_image_features(**inputs).pooler_output
        ours_videos = model.get_multimodal_embeddings(**videos)
        expected_videos = hf_model.model.get_video_features(**videos).pooler_output
    assert [e.shape for e in ours] == [e.shape for e in expected]
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert [e.shape for e in ours_videos] == [e.shape for e in expected_videos]
    for a, b in zip(ours_videos, expected_videos):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_prefill_logits_match_hf(onevision):
    folder, hf_model, _, inputs, _ = onevision
    options = {"kv_cache_memory": "4MiB", "enable_prefix_caching": False, "limit_mm_per_prompt": LIMITS}
    llm = LLM(str(folder), device="cpu", block_size=BLOCK, **options)
    for i in range(len(PROMPTS)):
        with torch.no_grad():
            expected = hf_model(**inputs[i]).logits[0, -1].log_softmax(-1)
        ((_, logprobs),) = greedy_logprobs(llm, [request(i)], 1, expected.shape[0])
        torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


def preemption_cache_bytes(hf_model, inputs, longest: int) -> int:
    """KV bytes for exactly the blocks of the longest prompt and the text one (0): both start together,
    then the longest needs another block within its first 4 output tokens, when none is free."""
    text = hf_model.config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    bytes_per_token = text.num_hidden_layers * 2 * text.num_key_value_heads * head_dim * 4  # K and V, fp32
    lengths = [x["input_ids"].shape[1] for x in inputs]
    blocks = -(-lengths[longest] // BLOCK) + -(-lengths[0] // BLOCK)
    assert -(-(lengths[longest] + MAX_TOKENS) // BLOCK) <= blocks  # the longest fits alone
    return blocks * BLOCK * bytes_per_token


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "prefix-caching", "preemption"])
def test_greedy_tokens_match_hf_alone_and_batched(onevision, options):
    folder, hf_model, hf_processor, inputs, expected = onevision
    lengths = [x["input_ids"].shape[1] for x in inputs]
    longest = lengths.index(max(lengths))
    chunk = 20  # ends inside prompt 2's first image and prompt 3's video
    kwargs = {
        "default": {"enable_prefix_caching": False},
        "chunked-prefill": {"max_num_batched_tokens": chunk, "enable_prefix_caching": False},
        "prefix-caching": {},
        "preemption": {
            "kv_cache_memory": preemption_cache_bytes(hf_model, inputs, longest),
            "enable_prefix_caching": False,
        },
    }[options]
    if options == "chunked-prefill":  # some chunk ends inside an image and inside a video
        for token_id, i in ((hf_processor.image_token_id, 2), (hf_processor.video_token_id, 3)):
            ids = inputs[i]["input_ids"][0].eq(token_id).tolist()
            assert any(ids[k - 1] and ids[k] for k in range(chunk, len(ids), chunk))
    llm = LLM(
        str(folder), device="cpu", block_size=BLOCK, limit_mm_per_prompt=LIMITS, **{"kv_cache_memory": "4MiB", **kwargs}
    )
    assert [tokens(llm, [request(i)])[0] for i in range(len(PROMPTS))] == expected
    hits = llm.engine.core.block_manager.prefix_hits
    order = [longest, 0] + [i for i in range(1, len(PROMPTS)) if i != longest]
    assert tokens(llm, [request(i) for i in order]) == [expected[i] for i in order]
    if options == "prefix-caching":
        assert llm.engine.core.block_manager.prefix_hits > hits
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_loads_with_qwen2_backbone(onevision):
    model = load_model(ModelConfig(str(onevision[0]), device="cpu"))
    assert type(model.language_model).__name__ == "Qwen2ForCausalLM"
    assert type(model.vision_tower).__name__ == "SiglipVisionModel"


def test_chat_with_an_image_and_a_clip_gets_hf_answer(onevision, tmp_path):
    """An image (data URL) and a clip file through LLM.chat: the prompt and the answer are HF's for the
    chat template's text, the image and the clip's decoded frames."""
    folder, hf_model, hf_processor, _, _ = onevision
    (image,) = random_images([(90, 50)], seed=11)
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    path = tmp_path / "clip.mp4"
    path.write_bytes(video_bytes(num_frames=4, width=32, height=32, fps=4))
    frames = decode_video(path.read_bytes(), num_frames=4).frames
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "video_url", "video_url": {"url": str(path)}},
               {"type": "text", "text": "What happens?"}]  # fmt: skip
    hf_content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]
    text = hf_processor.apply_chat_template(
        [{"role": "user", "content": hf_content}], add_generation_prompt=True, tokenize=False
    )
    inputs = hf_inputs(hf_processor, text, {"image": [image], "video": [frames]})
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    llm = LLM(str(folder), device="cpu", kv_cache_memory="4MiB", limit_mm_per_prompt=LIMITS)
    messages = [{"role": "user", "content": content}]
    (output,) = llm.chat(messages, GREEDY, use_tqdm=False, media_io_kwargs={"video": {"num_frames": 4}})
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert output.outputs[0].token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()
