"""A tiny, randomly initialised Qwen2-Audio checkpoint in Hugging Face folder format, built offline.

Audio: a Whisper-style encoder, width 32, 2 layers, 2 heads, 16 mel bins, over 2-second windows (the
feature extractor's chunk_length: 200 mel frames -> 100 positions -> 50 tokens at most). Text: Qwen2, hidden
32, 2 layers. The tokenizer is the Qwen-VL test tokenizer with `<|AUDIO|>`, `<|audio_bos|>`, `<|audio_eos|>`;
the processor's own chat template ("Audio N: ...").
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken
from transformers import (
    Qwen2AudioConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2AudioProcessor,
    WhisperFeatureExtractor,
)

from .audio import random_audio  # noqa: F401  (the tests' audio, with the model)
from .checkpoints import save_widened_random_weights
from .tokenizer import build_tokenizer

SAMPLING_RATE, CHUNK_SECONDS, MEL_BINS = 16000, 2, 16
AUDIO_TOKENS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]


def build_tiny_qwen2_audio(folder, *, seed: int = 0) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer, processor) to `folder`; returns it."""
    tokenizer = build_tokenizer("qwen")
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(t, normalized=False) for t in AUDIO_TOKENS]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|AUDIO|>", "<|im_end|>", "<|endoftext|>")}
    text = dict(
        model_type="qwen2", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )  # fmt: skip
    positions = CHUNK_SECONDS * SAMPLING_RATE // 160 // 2  # mel frames of a window, halved by the strided conv
    audio = dict(
        model_type="qwen2_audio_encoder", d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
        num_mel_bins=MEL_BINS, max_source_positions=positions,
    )  # fmt: skip
    config = Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=ids["<|AUDIO|>"])
    folder = Path(folder)
    save_widened_random_weights(Qwen2AudioForConditionalGeneration, config, folder, seed)
    extractor = WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLING_RATE, chunk_length=CHUNK_SECONDS)
    Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(folder)
    return folder
