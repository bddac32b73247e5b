"""Gemma 4 against Hugging Face transformers on tiny checkpoints (fp32), in both released shapes (testkit/gemma4.py):
"e" (per-layer embeddings, the last 3 of 6 layers reading earlier layers' KV cache, images, video and audio) and
"moe" (routed experts beside the dense MLP, wide keys-as-values full layers, images and video). The processor's
ids (images of several sizes, a video, audio; with and without the processor cache), prefill logits, and greedy
tokens for a conversation with an image, a video and an audio clip, alone, batched with a text request, chunked,
from the prefix cache and under preemption; the KV plan holding shared layers once; the text-only model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoProcessor, Gemma4ForConditionalGeneration

from tessera import LLM, SamplingParams
from tessera.layers.fused_moe import FusedMoE
from tessera.layers.kv_cache import kv_cache_bytes_per_block
from tessera.multimodal import MULTIMODAL_REGISTRY
from testkit import random_images
from testkit.audio import random_audio
from testkit.gemma4 import build_tiny_gemma4
from testkit.generation import (
    ENGINE_CASES,
    assert_engine_case_happened,
    engine_case_options,
    greedy_logprobs,
    kv_bytes_per_token,
)
from testkit.inputs import random_video

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
CHUNK = 330  # the worst-case video (4 frames of 70 soft tokens) is prefilled in one step; audio may split


def media(kind: str, seed: int = 0) -> dict:
    data = {"image": random_images([(60, 40)], seed=seed), "video": [random_video(4, 64, 48, seed=seed)]}
    if kind == "e":
        data["audio"] = [random_audio(1.3, seed=seed)]
    return data


def conversation(kind: str) -> str:
    """One user turn with an image, a video and (where the model hears) an audio clip, as the template writes it."""
    hear = " Then listen: <|audio|> What is said?" if kind == "e" else ""
    return f"<|turn>user\nLook: <|image|> and watch <|video|> closely.{hear}<turn|>\n<|turn>model\n"


TEXT = "<|turn>user\nWrite a long story about a sliding window and its experts.<turn|>\n<|turn>model\n"


def requests(kind: str) -> list:
    return [{"prompt": conversation(kind), "multi_modal_data": media(kind)}, {"prompt": TEXT}]


def hf_inputs(processor, request: dict):
    data = request.get("multi_modal_data", {})
    kwargs = {"images": data.get("image"), "videos": data.get("video"), "audio": data.get("audio")}
    return processor(text=request["prompt"], return_tensors="pt", **{k: v for k, v in kwargs.items() if v})


@pytest.fixture(scope="module", params=["e", "moe"])
def gemma4(request, tmp_path_factory):
    """(kind, folder, HF processor, HF's last-token log-probs for the media request, HF's greedy tokens)."""
    folder = build_tiny_gemma4(tmp_path_factory.mktemp(f"gemma4_{request.param}"), kind=request.param)
    hf_model = Gemma4ForConditionalGeneration.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    expected = []
    with torch.no_grad():
        for i, r in enumerate(requests(request.param)):
            inputs = hf_inputs(processor, r)
            if i == 0:
                logprobs = hf_model(**inputs).logits[0, -1].log_softmax(-1)
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
            expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return request.param, folder, processor, logprobs, expected


@pytest.mark.parametrize("cache_gb", [0, 1])
def test_processor_matches_hf(gemma4, cache_gb):
    kind, folder, hf_processor, _, _ = gemma4
    processor = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=cache_gb)
    prompt = "Two: <|image|> and <|image|>, a clip <|video|>" + (" and <|audio|> <|audio|>" if kind == "e" else "")
    data = {"image": random_images([(30, 200), (500, 90)], seed=3), "video": [random_video(7, 90, 50, seed=4)]}
    if kind == "e":
        data["audio"] = [random_audio(0.7, seed=5), random_audio(2.1, seed=6)]
    hf = hf_inputs(hf_processor, {"prompt": prompt, "multi_modal_data": data})
    for _ in range(2):  # the second call hits the processor cache when there is one
        out = processor.apply(prompt, data)
        assert out["prompt_token_ids"] == hf["input_ids"][0].tolist()
        # only the soft tokens take embeddings, one per HF mm_token_type_ids position
        embeds = sum(int(p.get_num_embeds()) for items in out["mm_placeholders"].values() for p in items)
        assert embeds == int((hf["mm_token_type_ids"][0] > 0).sum())


def test_prefill_logits_match_hf(gemma4):
    kind, folder, _, expected, _ = gemma4
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="8MiB")
    ((_, logprobs),) = greedy_logprobs(llm, requests(kind)[:1], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_greedy_tokens_match_hf_alone_and_batched(gemma4, case):
    kind, folder, _, _, expected = gemma4
    lengths = [0] * len(requests(kind))  # only preemption sizes its cache from the prompts
    if case == "preemption":
        probe = LLM(str(folder), device="cpu", kv_cache_memory="8MiB")
        lengths = [len(probe.engine.input_preprocessor.process(r, GREEDY).token_ids) for r in requests(kind)]
    text_config = AutoConfig.from_pretrained(folder).text_config
    options = engine_case_options(case, text_config=text_config, prompt_lens=lengths, chunk=CHUNK)
    llm = LLM(str(folder), device="cpu", block_size=4, **{"kv_cache_memory": "8MiB", **options})
    assert [tokens(llm, [r])[0] for r in requests(kind)] == expected
    hits = llm.engine.core.block_manager.prefix_hits
    assert tokens(llm, requests(kind)) == expected  # batched: the media conversation and a text request
    assert_engine_case_happened(llm, case, hits)


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_the_kv_plan_holds_shared_layers_once(gemma4):
    """Bytes a block costs = the layers that write a cache, each with its own geometry (first principles from
    the HF config: the "reuse" layers hold nothing); the shared layers attend over their store layer's tensors."""
    kind, folder, _, _, _ = gemma4
    llm = LLM(str(folder), device="cpu", kv_cache_memory="8MiB")
    model = llm.engine.core.model
    text_config = model.config.text_config
    assert kv_cache_bytes_per_block(model, 4, torch.float32) == 4 * kv_bytes_per_token(text_config)
    layers = model.language_model.model.layers
    for layer, mode in zip(layers, text_config.kv_sharing_modes):
        attn = layer.self_attn.attn
        assert bool(attn.kv_source) == (mode == "reuse")
        if attn.kv_source:
            assert attn.k_cache.data_ptr() == attn.kv_source[0].k_cache.data_ptr()
    assert any(text_config.kv_sharing_modes) == (kind == "e")


def test_moe_decode_runs_only_the_routed_experts(gemma4):
    """The MoE model's decode step runs exactly top-k experts in each layer; the e model has none."""
    kind, folder, _, _, _ = gemma4
    llm = LLM(str(folder), device="cpu", kv_cache_memory="8MiB", enable_prefix_caching=False)
    layers = [m for m in llm.engine.core.model.modules() if isinstance(m, FusedMoE)]
    if kind == "e":
        assert not layers
        return
    runs = []
    for max_tokens in (1, 4):  # the same prefill, then 3 decode steps more
        before = [m.experts_run for m in layers]
        llm.generate(TEXT, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
        runs.append([m.experts_run - b for m, b in zip(layers, before)])
    assert len(layers) == 6 and [b - a for a, b in zip(*runs)] == [3 * m.top_k for m in layers]


def test_a_clip_longer_than_the_processor_takes_is_refused_by_name(gemma4):
    kind, folder, _, _, _ = gemma4
    llm = LLM(str(folder), device="cpu", kv_cache_memory="8MiB")
    request = {"prompt": "Hear <|audio|>", "multi_modal_data": {"audio": [random_audio(5.0)]}}
    with pytest.raises(ValueError, match="audio_seq_length" if kind == "e" else "audio"):
        llm.generate([request], GREEDY, use_tqdm=False)
    assert tokens(llm, [TEXT])[0]  # the engine serves on


@pytest.mark.parametrize("kind", ["e", "moe"])
def test_the_text_only_model_matches_hf(tmp_path, kind):
    """Gemma4ForCausalLM (model_type gemma4_text) from the same text config: logits and greedy tokens."""
    from transformers import Gemma4ForCausalLM

    from testkit.checkpoints import save_widened_random_weights
    from testkit.gemma4 import gemma4_config, gemma4_tokenizer
    from testkit.generation import hf_greedy_tokens

    tokenizer = gemma4_tokenizer()
    save_widened_random_weights(Gemma4ForCausalLM, gemma4_config(tokenizer, kind).text_config, tmp_path, seed=1)
    tokenizer.save_pretrained(tmp_path)
    hf_model = Gemma4ForCausalLM.from_pretrained(tmp_path).eval()
    prompts = [TEXT, "One two three four five six seven eight nine ten eleven twelve"]
    expected = hf_greedy_tokens(hf_model, tokenizer, prompts, MAX_TOKENS)
    llm = LLM(str(tmp_path), device="cpu", block_size=4, kv_cache_memory="4MiB", max_num_batched_tokens=5)
    assert tokens(llm, prompts) == expected  # batched, in chunks of 5 (the sliding window is 8)
    with torch.no_grad():
        hf_last = hf_model(torch.tensor([tokenizer.encode(prompts[0])])).logits[0, -1].log_softmax(-1)
    ((_, logprobs),) = greedy_logprobs(llm, prompts[:1], 1, hf_last.shape[0])
    torch.testing.assert_close(logprobs[0], hf_last, atol=1e-4, rtol=0)


def test_int8_quantizes_the_language_model_only(gemma4):
    """Weight-only int8: the decoder's linears (experts included) quantize, the towers and embedders do not, and
    the media conversation still runs."""
    from tessera.layers.linear import Linear

    kind, folder, _, _, _ = gemma4
    llm = LLM(str(folder), device="cpu", kv_cache_memory="8MiB", quantization="int8")
    model = llm.engine.core.model
    decoder = [m for m in model.language_model.modules() if isinstance(m, Linear)]
    assert decoder and all(m.qweight is not None for m in decoder)
    for part in ("vision_tower", "embed_vision", "audio_tower", "embed_audio"):
        if getattr(model, part) is not None:
            assert all(m.qweight is None for m in getattr(model, part).modules() if isinstance(m, Linear))
    assert len(tokens(llm, requests(kind)[:1])[0]) == MAX_TOKENS


def test_a_chat_with_image_video_and_audio_parts_gets_hfs_answer(gemma4, tmp_path):
    """`LLM.chat` with image_url, video_url (an 8-frame file at 2 fps: the processor samples 4 frames, stamped
    00:00 .. 00:03) and input_audio parts renders the model's chat template as HF's processor does and answers
    as HF does on the same media."""
    import base64

    from PIL import Image
    from transformers.video_utils import VideoMetadata

    from testkit import video_bytes
    from testkit.audio import wav_bytes

    kind, folder, processor, _, _ = gemma4
    image_path, video_path = tmp_path / "a.png", tmp_path / "v.mp4"
    random_images([(70, 50)], seed=8)[0].save(image_path)
    video_path.write_bytes(video_bytes(num_frames=8, width=64, height=48, fps=2))
    content = [{"type": "image_url", "image_url": {"url": str(image_path)}},
               {"type": "video_url", "video_url": {"url": str(video_path)}}]  # fmt: skip
    hf_content = [{"type": "image"}, {"type": "video"}]
    if kind == "e":
        recording = base64.b64encode(wav_bytes(random_audio(1.1, seed=9))).decode()
        content.append({"type": "input_audio", "input_audio": {"data": recording, "format": "wav"}})
        hf_content.append({"type": "audio"})
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": "What happens?"}]}]
    hf_messages = [{"role": "user", "content": [*hf_content, {"type": "text", "text": "What happens?"}]}]
    llm = LLM(str(folder), device="cpu", kv_cache_memory="8MiB")
    prompt = llm.render_chat(messages)
    hf_text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    assert prompt["prompt"] == hf_text.removeprefix("<s>")  # the BOS the template writes comes from tokenizing
    (video,) = prompt["multi_modal_data"]["video"]
    kwargs = dict(
        images=[Image.open(image_path)], videos=[video.frames], video_metadata=[VideoMetadata(**video.metadata)]
    )
    if kind == "e":
        ((waveform, rate),) = prompt["multi_modal_data"]["audio"]
        assert rate == 16000
        kwargs["audio"] = [waveform]
    inputs = processor(text=prompt["prompt"], return_tensors="pt", **kwargs)
    assert "00:03" in processor.tokenizer.decode(inputs["input_ids"][0])
    hf_model = Gemma4ForConditionalGeneration.from_pretrained(folder).eval()
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    (output,) = llm.chat(messages, GREEDY, use_tqdm=False)
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert output.outputs[0].token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()


def test_the_weight_log_counts_the_per_layer_embeddings(gemma4, caplog):
    """The loader logs what the weights take: all of them (as many bytes as HF's state dict holds, each tensor once)
    and the per-layer embedding tables (vocab x layers x P floats), which Gemma 4's E models spend most of it on."""
    import logging

    kind, folder, _, _, _ = gemma4
    hf_model = Gemma4ForConditionalGeneration.from_pretrained(folder)
    unique = {(t.data_ptr(), t.numel()): t.numel() * t.element_size() for t in hf_model.state_dict().values()}
    with caplog.at_level(logging.INFO, logger="tessera.models.loader"):
        LLM(str(folder), device="cpu", kv_cache_memory="8MiB")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Weights:")]
    assert line.startswith(f"Weights: {sum(unique.values()) / 2**20:.1f} MiB (")
    text = hf_model.config.text_config
    if kind == "e":
        table = text.vocab_size_per_layer_input * text.num_hidden_layers * text.hidden_size_per_layer_input * 4
        assert f"per-layer embeddings {table / 2**20:.1f} MiB" in line
    else:
        assert "per-layer" not in line
