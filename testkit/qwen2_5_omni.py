"""A tiny, randomly initialised Qwen2.5-Omni thinker checkpoint in Hugging Face folder format, built offline.

Text: Qwen2 with M-RoPE (sections [1, 1, 2]), hidden 32, 2 layers. Vision: Qwen2.5-Omni's tower (Qwen2.5-VL's
with q, k, v apart), depth 2, patch 14, window 28 px. Audio: its chunked Whisper encoder, 16 mel bins, 1-second
windows (n_window 50). The tokenizer is the Qwen-VL test tokenizer with Omni's tokens, named as the processor
reads them (audio_token, image_token, ...), and the published chat template; the processor keeps images and
video frames between 56x56 and 112x112 pixels.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken
from transformers import (
    Qwen2_5OmniProcessor,
    Qwen2_5OmniThinkerConfig,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
    WhisperFeatureExtractor,
)

from .checkpoints import save_widened_random_weights
from .tokenizer import build_tokenizer

# The published Qwen2.5-Omni chat template (tokenizer/processor chat_template), verbatim.
OMNI_CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}{% set image_count = namespace(value=0) %}"
    "{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"  # noqa: E501
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"  # noqa: E501
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}{% if add_audio_id %}Audio {{ audio_count.value }}: {% endif %}"
    "<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"  # noqa: E501
    "<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEFAULT_SYSTEM = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)

# attribute name on the tokenizer -> token; Qwen2_5OmniProcessor.__init__ reads these attributes.
OMNI_TOKEN_ATTRS = {
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
    "image_token": "<|IMAGE|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
}
PATCH, MERGE, TPATCH = 14, 2, 2
MEL_BINS, N_WINDOW = 16, 50  # audio chunks of 2 * n_window = 100 mel frames (1 s)
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 16  # 56x56 images stay 56x56 (4 merged tokens)


def build_omni_tokenizer():
    tok = build_tokenizer("qwen")  # <|endoftext|>, <|im_start|>, <|im_end|>, ... and 512 BPE tokens
    tok.add_special_tokens(
        {
            "additional_special_tokens": [
                AddedToken(t, normalized=False, special=True) for t in OMNI_TOKEN_ATTRS.values()
            ]
        }  # noqa: E501
    )
    # v5: extra_special_tokens given as a dict become named attributes (tok.audio_token, tok.audio_token_id...)
    # and are written to tokenizer_config.json, so AutoProcessor restores them.
    tok2 = type(tok)(
        tokenizer_object=tok.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
        extra_special_tokens=dict(OMNI_TOKEN_ATTRS),
        chat_template=OMNI_CHAT_TEMPLATE,
    )
    return tok2


def build_tiny_qwen2_5_omni(folder, *, seed: int = 0) -> Path:
    """Write the thinker checkpoint (config, safetensors, tokenizer, processor) to `folder`; returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_omni_tokenizer()
    names = [*OMNI_TOKEN_ATTRS.values(), "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    ids = {t: tok.convert_tokens_to_ids(t) for t in names}
    text = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=32,
        in_channels=3,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TPATCH,
        hidden_act="silu",
        window_size=28,
        fullatt_block_indexes=[1],  # window 28 px = 1 merged token a side
    )
    audio = dict(
        num_mel_bins=MEL_BINS,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=64,
        d_model=32,
        max_source_positions=1500,
        n_window=N_WINDOW,
        output_dim=32,
    )
    config = Qwen2_5OmniThinkerConfig(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        audio_token_index=ids["<|AUDIO|>"],
        image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"],
        # not declared fields of Qwen2_5OmniThinkerConfig but read by get_rope_index (published configs carry them)
        vision_start_token_id=ids["<|vision_bos|>"],
        vision_end_token_id=ids["<|vision_eos|>"],
        position_id_per_seconds=25,
        seconds_per_chunk=2,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    save_widened_random_weights(Qwen2_5OmniThinkerForConditionalGeneration, config, folder, seed)

    vis = dict(patch_size=PATCH, temporal_patch_size=TPATCH, merge_size=MERGE, min_pixels=MIN_PIXELS,
               max_pixels=MAX_PIXELS)  # fmt: skip
    processor = Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(**vis),
        video_processor=Qwen2VLVideoProcessor(**vis),
        feature_extractor=WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=16000),
        tokenizer=tok,
        chat_template=OMNI_CHAT_TEMPLATE,
    )
    processor.save_pretrained(folder)
    return folder
