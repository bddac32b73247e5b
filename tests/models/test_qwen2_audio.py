"""Qwen2-Audio against Hugging Face transformers on a tiny checkpoint (fp32): the processor's token ids and
log-mel features (short, window-length and over-long recordings, two in a prompt, a waveform at another rate),
the encoder's features, prefill logits, and greedy tokens alone, batched with a text prompt, in prefill chunks
cutting an audio, from the prefix cache (keyed by the audio's content) and under preemption."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoProcessor
from transformers import Qwen2AudioForConditionalGeneration as HFQwen2Audio

from tessera import LLM, SamplingParams
from tessera.multimodal import MULTIMODAL_REGISTRY
from tessera.multimodal.audio import resample
from testkit.generation import greedy_logprobs
from testkit.qwen2_audio import build_tiny_qwen2_audio, random_audio

AUDIO = "Audio {}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
ONE = "<|im_start|>user\n" + AUDIO.format(1) + "What is it?<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\n" + AUDIO.format(1) + AUDIO.format(2) + "Compare.<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nHello there, how are you today?<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def two_audios():
    return [random_audio(1.3, seed=1), random_audio(0.4, seed=2)]


@pytest.fixture(scope="module")
def qwen2_audio(tmp_path_factory):
    """(folder, HF model, HF processor, HF's last-token log-probs for TWO, greedy tokens for TWO and ONE)."""
    folder = build_tiny_qwen2_audio(tmp_path_factory.mktemp("tiny_qwen2_audio"))
    hf_model = HFQwen2Audio.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    expected = []
    with torch.no_grad():
        for prompt, audios in requests_data():
            inputs = processor(text=prompt, audio=audios, sampling_rate=16000, return_tensors="pt")
            if prompt == TWO:
                logprobs = hf_model(**inputs).logits[0, -1].log_softmax(-1)
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
            expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return folder, hf_model, processor, logprobs, expected


def requests_data():
    return [(TWO, two_audios()), (ONE, [random_audio(1.7, seed=3)])]


def requests():
    return [{"prompt": prompt, "multi_modal_data": {"audio": audios}} for prompt, audios in requests_data()]


@pytest.mark.parametrize("seconds", [[1.3, 0.4], [2.0], [3.5], [0.05]], ids=["two", "window", "longer", "short"])
def test_processor_matches_hf(qwen2_audio, seconds):
    folder, _, processor, _, _ = qwen2_audio
    audios = [random_audio(s, seed=i) for i, s in enumerate(seconds)]
    prompt = "".join(AUDIO.format(i + 1) for i in range(len(audios))) + "Listen."
    hf = processor(text=prompt, audio=audios, sampling_rate=16000, return_tensors="pt")
    ours = MULTIMODAL_REGISTRY.create_processor(folder).apply(prompt, {"audio": audios})
    assert ours["prompt_token_ids"] == hf["input_ids"][0].tolist()
    items = ours["mm_kwargs"].get_items("audio")
    torch.testing.assert_close(torch.stack([item["input_features"].data for item in items]), hf["input_features"])


def test_a_waveform_at_another_rate_is_resampled_first(qwen2_audio):
    folder, _, processor, _, _ = qwen2_audio
    at_16k = random_audio(1.0, seed=4)
    at_44k = resample(at_16k, 16000, 44100)
    ours = MULTIMODAL_REGISTRY.create_processor(folder).apply(AUDIO.format(1), {"audio": (at_44k, 44100)})
    back = resample(at_44k, 44100, 16000)
    hf = processor(text=AUDIO.format(1), audio=[back], sampling_rate=16000, return_tensors="pt")
    assert ours["prompt_token_ids"] == hf["input_ids"][0].tolist()
    (item,) = ours["mm_kwargs"].get_items("audio")
    torch.testing.assert_close(item["input_features"].data, hf["input_features"][0])


def test_encoder_features_match_hf(qwen2_audio):
    from tessera.config import ModelConfig
    from tessera.models.loader import load_model

    folder, hf_model, processor, _, _ = qwen2_audio
    model = load_model(ModelConfig(str(folder), device="cpu"))
    inputs = processor(text=TWO, audio=two_audios(), sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        ours = model.get_multimodal_embeddings(
            input_features=inputs["input_features"], feature_attention_mask=inputs["feature_attention_mask"]
        )
        hf_embeds = hf_model.model.get_input_embeddings()(inputs["input_ids"])
        merged = model.get_input_embeddings(inputs["input_ids"][0], ours)
    mask = inputs["input_ids"][0] == hf_model.config.audio_token_id
    assert sum(len(item) for item in ours) == int(mask.sum())
    torch.testing.assert_close(merged[~mask], hf_embeds[0][~mask])  # text rows untouched


def test_prefill_logits_match_hf(qwen2_audio):
    folder, _, _, expected, _ = qwen2_audio
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="4MiB")
    ((_, logprobs),) = greedy_logprobs(llm, requests()[:1], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "prefix-caching", "preemption"])
def test_greedy_tokens_match_hf_alone_and_batched(qwen2_audio, options):
    folder, _, _, _, expected = qwen2_audio
    kwargs = {
        "default": {"enable_prefix_caching": False},
        "chunked-prefill": {"max_num_batched_tokens": 9, "enable_prefix_caching": False},  # audio runs cut
        "prefix-caching": {},
        # 2 layers x K and V x 2 heads x 8 dims x 4 bytes = 256 bytes a token: 32 blocks of 4, which the
        # two-audio prompt (88 tokens, 22 blocks) and the text one (37 tokens, 10 blocks) fill, so the first
        # needs a 23rd block at its first generated token
        "preemption": {"kv_cache_memory": 32 * 4 * 256, "enable_prefix_caching": False},
    }[options]
    llm = LLM(str(folder), device="cpu", block_size=4, **{"kv_cache_memory": "4MiB", **kwargs})
    assert [tokens(llm, [r])[0] for r in requests()] == expected
    hits = llm.engine.core.block_manager.prefix_hits
    two, one = requests()
    assert tokens(llm, [two, TEXT, one])[::2] == expected  # batched with a text prompt
    if options == "prefix-caching":
        assert llm.engine.core.block_manager.prefix_hits > hits
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_chat_with_input_audio_and_audio_url_gets_hfs_answer(qwen2_audio, tmp_path):
    """An OpenAI `input_audio` part (base64 WAV at 44.1 kHz) and an `audio_url` part (a WAV file) through
    LLM.chat and the processor's own chat template: HF's prompt and answer for the same recordings."""
    import base64

    from tessera.multimodal.audio import decode_audio
    from tests.multimodal.test_audio import wav_bytes

    folder, hf_model, processor, _, _ = qwen2_audio
    first, second = wav_bytes(random_audio(1.0, seed=5, rate=44100), 44100), wav_bytes(random_audio(0.6, seed=6), 16000)
    path = tmp_path / "second.wav"
    path.write_bytes(second)
    messages = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(first).decode(), "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": str(path)}},
        {"type": "text", "text": "Compare them."},
    ]}]  # fmt: skip
    hf_messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "audio"},
                                                {"type": "text", "text": "Compare them."}]}]  # fmt: skip
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    audios = [decode_audio(first, 16000), decode_audio(second, 16000)]
    inputs = processor(text=text, audio=audios, sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    llm = LLM(str(folder), device="cpu", kv_cache_memory="4MiB")
    (output,) = llm.chat(messages, GREEDY, use_tqdm=False)
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert output.outputs[0].token_ids == out[0, inputs["input_ids"].shape[1] :].tolist()


def test_bad_audio_in_a_chat_is_a_clear_error_and_the_engine_goes_on(qwen2_audio):
    import base64

    from tessera.errors import InputError

    folder = qwen2_audio[0]
    llm = LLM(str(folder), device="cpu", kv_cache_memory="4MiB")
    bad = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(b"RIFF but not really a wave file").decode(), "format": "wav"}}]}]  # fmt: skip
    with pytest.raises(InputError, match="audio could not be decoded|no audio track"):
        llm.chat(bad, GREEDY, use_tqdm=False)
    part = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "xyz"}}
    wrong_format = [{"role": "user", "content": [part]}]
    with pytest.raises(InputError, match="format must be one of"):
        llm.chat(wrong_format, GREEDY, use_tqdm=False)
    assert tokens(llm, [TEXT])  # the engine still answers


def test_audio_limits_per_prompt_and_the_processor_cache(qwen2_audio):
    from tessera.errors import InputError

    folder = qwen2_audio[0]
    llm = LLM(str(folder), device="cpu", kv_cache_memory="4MiB", limit_mm_per_prompt={"audio": 1})
    two, one = requests()
    with pytest.raises((InputError, ValueError), match="At most 1 audio"):
        llm.generate(two, GREEDY, use_tqdm=False)
    first = tokens(llm, [one])
    queries, hits = llm.engine.stats()["processor_cache_queries"], llm.engine.stats()["processor_cache_hits"]
    assert tokens(llm, [one]) == first  # the same recording again: its features come from the cache
    stats = llm.engine.stats()
    assert stats["processor_cache_queries"] > queries and stats["processor_cache_hits"] > hits
