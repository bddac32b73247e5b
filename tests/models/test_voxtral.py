"""Voxtral against Hugging Face transformers on a tiny checkpoint (fp32) with a mistral-common tokenizer: the
chat's and the transcription request's token ids and log-mel features (HF's apply_chat_template and
apply_transcription_request), the encoder's features, prefill logits, and greedy tokens alone, batched with a
text chat, in prefill chunks cutting a recording, from the prefix cache and under preemption; transcripts
through LLM.transcribe and the server."""

from __future__ import annotations

import base64

import openai
import pytest
import torch
from transformers import AutoProcessor
from transformers import VoxtralForConditionalGeneration as HFVoxtral

from tessera import LLM, SamplingParams
from tessera.errors import InputError
from testkit.audio import random_audio, wav_bytes
from testkit.generation import greedy_logprobs
from testkit.voxtral import build_tiny_voxtral

MAX_TOKENS = 8
MAX_MODEL_LEN = 1536  # the start-up profile runs the longest item this allows: kept short
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SHORT, LONG = wav_bytes(random_audio(1.5, seed=1)), wav_bytes(random_audio(31.0, seed=2))  # 1 and 2 chunks


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def ours(recordings: list[bytes], text: str) -> list[dict]:
    parts = [{"type": "input_audio", "input_audio": {"data": b64(r), "format": "wav"}} for r in recordings]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def hfs(recordings: list[bytes], text: str) -> list[dict]:
    parts = [{"type": "audio", "base64": b64(r)} for r in recordings]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


CHATS = [([SHORT, LONG], "Compare them."), ([SHORT], "What is it?")]
TEXT = ([], "Hello there, how are you today?")


@pytest.fixture(scope="module")
def voxtral(tmp_path_factory):
    """(folder, HF model, HF processor, HF's last-token log-probs for the first chat, greedy tokens per chat)."""
    folder = build_tiny_voxtral(tmp_path_factory.mktemp("tiny_voxtral"))
    hf_model = HFVoxtral.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    expected = []
    with torch.no_grad():
        for i, chat in enumerate(CHATS):
            inputs = processor.apply_chat_template(hfs(*chat))
            if i == 0:
                logprobs = hf_model(**inputs).logits[0, -1].log_softmax(-1)
            out = hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
            expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return folder, hf_model, processor, logprobs, expected


def test_chat_ids_and_features_match_hfs_processor(voxtral):
    folder, _, processor, _, _ = voxtral
    llm = LLM(str(folder), device="cpu", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    hf = processor.apply_chat_template(hfs(*CHATS[0]))
    prompt = llm.render_chat(ours(*CHATS[0]))
    assert prompt["prompt_token_ids"] == hf["input_ids"][0].tolist()
    processed = llm.engine.processor.apply(prompt["prompt_token_ids"], prompt["multi_modal_data"])
    assert processed["prompt_token_ids"] == hf["input_ids"][0].tolist()
    items = processed["mm_kwargs"].get_items("audio")
    assert [int(item["audio_num_chunks"].data) for item in items] == [1, 2]
    torch.testing.assert_close(torch.cat([item["input_features"].data for item in items]), hf["input_features"])
    placeholders = processed["mm_placeholders"]["audio"]
    assert [p.length for p in placeholders] == [1 + 375, 1 + 750]  # [BEGIN_AUDIO] and 12.5 tokens a second


def test_encoder_features_match_hf(voxtral):
    from tessera.config import ModelConfig
    from tessera.models.loader import load_model

    folder, hf_model, processor, _, _ = voxtral
    model = load_model(ModelConfig(str(folder), device="cpu"))
    inputs = processor.apply_chat_template(hfs(*CHATS[0]))
    with torch.no_grad():
        embeddings = model.get_multimodal_embeddings(
            input_features=inputs["input_features"], audio_num_chunks=torch.tensor([1, 2])
        )
        expected = hf_model.get_audio_features(inputs["input_features"], return_dict=True).pooler_output
    torch.testing.assert_close(torch.cat(embeddings), expected)
    assert [len(e) for e in embeddings] == [375, 750]


def test_prefill_logits_match_hf(voxtral):
    folder, _, _, expected, _ = voxtral
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    ((_, logprobs),) = greedy_logprobs(llm, [llm.render_chat(ours(*CHATS[0]))], 1, expected.shape[0])
    torch.testing.assert_close(logprobs[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", ["default", "chunked-prefill", "prefix-caching", "preemption"])
def test_greedy_tokens_match_hf_alone_and_batched(voxtral, options):
    folder, _, _, _, expected = voxtral
    probe = LLM(str(folder), device="cpu", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    prompts = [probe.render_chat(ours(*chat)) for chat in CHATS]
    text = probe.render_chat(ours(*TEXT))
    # 2 layers x K and V x 2 heads x 8 dims x 4 bytes = 256 bytes a token: blocks of 4 for exactly the two chats'
    # prompts and the text's, so that generating needs blocks that only a preemption frees (the context is kept
    # short so that the start-up profile of the longest recording fits too)
    blocks = sum(-(-len(p["prompt_token_ids"]) // 4) for p in [*prompts, text])
    kwargs = {
        "default": {"enable_prefix_caching": False},
        "chunked-prefill": {"max_num_batched_tokens": 64, "enable_prefix_caching": False},  # recordings cut
        "prefix-caching": {},
        "preemption": {"kv_cache_memory": blocks * 4 * 256, "enable_prefix_caching": False, "max_model_len": 1200},
    }[options]
    llm = LLM(
        str(folder),
        device="cpu",
        block_size=4,
        **{"kv_cache_memory": "16MiB", "max_model_len": MAX_MODEL_LEN, **kwargs},
    )
    assert [tokens(llm, [p])[0] for p in prompts] == expected
    hits = llm.engine.core.block_manager.prefix_hits
    assert tokens(llm, [prompts[0], text, prompts[1]])[::2] == expected  # batched with a text chat
    if options == "prefix-caching":
        assert llm.engine.core.block_manager.prefix_hits > hits
    if options == "preemption":
        assert llm.engine.core.scheduler.num_preemptions > 0


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_transcription_is_hfs_transcription_request(voxtral):
    folder, hf_model, processor, _, _ = voxtral
    audio = random_audio(2.0, seed=7)
    hf = processor.apply_transcription_request(audio=audio, model_id="voxtral", language="fr",
                                               sampling_rate=16000, format="wav")  # fmt: skip
    with torch.no_grad():
        out = hf_model.generate(**hf, max_new_tokens=MAX_TOKENS, do_sample=False)
    expected = out[0, hf["input_ids"].shape[1] :].tolist()
    llm = LLM(str(folder), device="cpu", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    (window,) = llm.engine.transcriber.windows(audio, language="fr")  # Voxtral hears it whole
    assert window.prompt["prompt_token_ids"] == hf["input_ids"][0].tolist()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    (result,) = llm.transcribe(audio, params, language="French", use_tqdm=False)
    assert result.segments[0].token_ids == [t for t in expected if t != 2] and result.language == "fr"
    with pytest.raises(InputError, match="does not transcribe language 'ja'"):
        llm.transcribe(audio, params, language="ja")


def test_text_prompts_cannot_carry_audio(voxtral):
    llm = LLM(str(voxtral[0]), device="cpu", kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    with pytest.raises(InputError, match="through chat messages"):
        llm.generate({"prompt": "Listen.", "multi_modal_data": {"audio": random_audio(1.0)}}, GREEDY)
    assert tokens(llm, [llm.render_chat(ours(*TEXT))])  # the engine still answers


def test_the_server_transcribes_and_chats_as_offline(voxtral):
    from tessera.engine.async_engine import AsyncEngine
    from tessera.engine.llm_engine import LLMEngine
    from tessera.entrypoints.openai.api_server import ServerThread, build_app

    folder = str(voxtral[0])
    engine = AsyncEngine(LLMEngine.from_options(folder, kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN))
    offline = LLM(folder, kv_cache_memory="16MiB", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    try:
        with ServerThread(build_app(engine, model_name="vox")) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none")
            text = client.audio.transcriptions.create(
                model="vox", file=("a.wav", SHORT), language="en", extra_body={"max_completion_tokens": MAX_TOKENS}
            ).text
            reply = client.chat.completions.create(model="vox", messages=ours(*CHATS[1]), max_tokens=MAX_TOKENS,
                                                   temperature=0)  # fmt: skip
    finally:
        engine.shutdown()
    (expected,) = offline.transcribe(SHORT, params, language="en", use_tqdm=False)
    (answer,) = offline.chat(ours(*CHATS[1]), params, use_tqdm=False)
    assert text == expected.text and reply.choices[0].message.content == answer.outputs[0].text
