"""A tiny, randomly initialised Voxtral checkpoint in Hugging Face folder format, built offline.

Voxtral's tokenizer is mistral-common's Tekken (`tekken.json`, read by transformers' MistralCommonBackend):
here a byte-level vocabulary (256 bytes and a few merges) behind Voxtral's special tokens at their real ids
(`[AUDIO]` 24, `[BEGIN_AUDIO]` 25, `[TRANSCRIBE]` 34), with the audio section Voxtral's file has: 16 kHz,
12.5 tokens per second, 30-second chunks. Audio: a Whisper encoder, width 16, 2 layers, 16 mel bins, over the
real 30-second window (3000 mel frames -> 1500 positions -> 375 tokens after packing 4 frames per token).
Text: Llama, hidden 32, 2 layers.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from transformers import VoxtralConfig, VoxtralForConditionalGeneration, WhisperFeatureExtractor

from .audio import random_audio  # noqa: F401  (the tests' audio, with the model)
from .checkpoints import save_widened_random_weights

SAMPLING_RATE, MEL_BINS = 16000, 16
PATTERN = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"  # noqa: E501
SPECIAL = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]",
    "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]", "<SPECIAL_20>", "<SPECIAL_21>",
    "<SPECIAL_22>", "<SPECIAL_23>", "[AUDIO]", "[BEGIN_AUDIO]", "<SPECIAL_26>", "<SPECIAL_27>", "<SPECIAL_28>",
    "<SPECIAL_29>", "<SPECIAL_30>", "<SPECIAL_31>", "[ARGS]", "[CALL_ID]", "[TRANSCRIBE]",
]  # fmt: skip
NUM_SPECIAL = 40  # the rest: <SPECIAL_35> ...
MERGES = ["th", "he", "in", "er", "an", " t", " a", "on", "at", "en", "es", "or", "is", "it", " w", "ou"]


def tekken_json() -> dict:
    """A Tekken v7 tokenizer file: the bytes, a few merges, Voxtral's special tokens and audio settings."""
    tokens = [bytes([b]) for b in range(256)] + [m.encode() for m in MERGES]
    vocab = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
             for i, t in enumerate(tokens)]  # fmt: skip
    names = SPECIAL + [f"<SPECIAL_{i}>" for i in range(len(SPECIAL), NUM_SPECIAL)]
    special = [{"rank": i, "token_str": name, "is_control": True} for i, name in enumerate(names)]
    return {
        "config": {"pattern": PATTERN, "num_vocab_tokens": len(tokens), "default_vocab_size": NUM_SPECIAL + len(tokens),
                   "default_num_special_tokens": NUM_SPECIAL, "version": "v7"},  # fmt: skip
        "vocab": vocab,
        "special_tokens": special,
        "audio": {"sampling_rate": SAMPLING_RATE, "frame_rate": 12.5, "chunk_length_s": 30.0,
                  "audio_encoding_config": {"num_mel_bins": MEL_BINS, "hop_length": 160, "window_size": 400}},
    }  # fmt: skip


def build_tiny_voxtral(folder, *, seed: int = 0) -> Path:
    """Write the checkpoint (config, safetensors, tekken.json, feature extractor) to `folder`; returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tekken = tekken_json()
    (folder / "tekken.json").write_text(json.dumps(tekken))
    vocab_size = tekken["config"]["default_vocab_size"]
    text = dict(
        model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 100000000.0},
    )  # fmt: skip
    audio = dict(
        model_type="voxtral_encoder", hidden_size=16, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_mel_bins=MEL_BINS, max_source_positions=1500,
    )  # fmt: skip
    config = VoxtralConfig(audio_config=audio, text_config=text, audio_token_id=24, projector_hidden_act="gelu")
    save_widened_random_weights(VoxtralForConditionalGeneration, config, folder, seed)
    WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE).save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "VoxtralProcessor"}))
    return folder
