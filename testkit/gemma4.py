"""Tiny, randomly initialised Gemma 4 checkpoints (Gemma4ForConditionalGeneration) in Hugging Face folder format,
built offline, in the two shapes Google released:

- "e" (the E2B/E4B kind): dense MLPs, per-layer input embeddings (PLE, 8 per layer) and the last 3 of 6 layers
  sharing the KV cache of earlier ones (`num_kv_shared_layers`), with vision and audio towers;
- "moe" (the 26B-A4B kind): routed experts beside the dense MLP (8 experts, top 2), full-attention layers with
  a wider head (`global_head_dim`) and keys as values (`attention_k_eq_v`), a vision tower.

Both: hidden 64, 4 heads, sliding layers (window 8) over 2 KV heads of 16, full layers every third, final logits
soft-capped, image and video runs attending both ways on sliding layers (`use_bidirectional_attention`
"vision"). Vision: 16-pixel patches pooled 3x3, width 32, 2 layers; the processors keep the smallest budget HF
allows (70 soft tokens an image or a frame). Audio: the conformer at width 32, 2 layers, 16 mel bins. The
tokenizer is the "llava" test tokenizer with Gemma 4's media tokens; the chat template writes `<|image|>`,
`<|video|>` and `<|audio|>` for media parts, which the processor expands. Its audio_seq_length allows clips of 4 s
(100 soft tokens), so that a KV cache of a few hundred tokens holds the worst case.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken
from transformers import (
    Gemma4AudioFeatureExtractor,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessor,
    Gemma4Processor,
    Gemma4VideoProcessor,
    PreTrainedTokenizerFast,
)

from .checkpoints import save_widened_random_weights
from .tokenizer import build_tokenizer

BOI, IMAGE, EOI = "<|image>", "<|image|>", "<image|>"
BOA, AUDIO, EOA = "<|audio>", "<|audio|>", "<audio|>"
VIDEO = "<|video|>"
MEL_BINS, SOFT_TOKENS, AUDIO_TOKENS = 16, 70, 100  # audio: clips up to 4 s (40 ms a token)
GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|turn>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|video|>' }}{% elif part['type'] == 'audio' %}{{ '<|audio|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<turn|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)


def gemma4_tokenizer() -> PreTrainedTokenizerFast:
    """The "llava" test tokenizer (BOS `<s>`) with Gemma 4's media tokens, named as the processor wants them."""
    backend = build_tokenizer("llava").backend_tokenizer
    tokens = (BOI, IMAGE, EOI, BOA, AUDIO, EOA, VIDEO, "<|turn>", "<turn|>")
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        extra_special_tokens={"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI, "boa_token": BOA,
                              "audio_token": AUDIO, "eoa_token": EOA},
        chat_template=GEMMA4_CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )  # fmt: skip


def gemma4_config(tokenizer: PreTrainedTokenizerFast, kind: str = "e", **text_overrides) -> Gemma4Config:
    """The config of a tiny checkpoint of `kind` "e" or "moe" (see the module docstring), its text config's fields
    overridden by `text_overrides`."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOI, IMAGE, EOI, BOA, AUDIO, EOA, VIDEO)}
    text = dict(
        vocab_size=len(tokenizer), vocab_size_per_layer_input=len(tokenizer), hidden_size=64, intermediate_size=96,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, final_logit_softcapping=30.0,
        max_position_embeddings=4096, use_bidirectional_attention="vision", pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    if kind == "e":
        text.update(hidden_size_per_layer_input=8, num_kv_shared_layers=3, global_head_dim=16)
    else:
        text.update(hidden_size_per_layer_input=0, global_head_dim=32, num_global_key_value_heads=1,
                    attention_k_eq_v=True, enable_moe_block=True, num_experts=8, top_k_experts=2,
                    moe_intermediate_size=24)  # fmt: skip
    text.update(text_overrides)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, pooling_kernel_size=3, patch_size=16,
                  position_embedding_size=64)  # fmt: skip
    audio = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, subsampling_conv_channels=[MEL_BINS, 8],
                 output_proj_dims=48, conv_kernel_size=5)  # fmt: skip
    return Gemma4Config(
        text_config=text, vision_config=vision, audio_config=audio if kind == "e" else None,
        image_token_id=ids[IMAGE], video_token_id=ids[VIDEO], audio_token_id=ids[AUDIO], boi_token_id=ids[BOI],
        eoi_token_id=ids[EOI], boa_token_id=ids[BOA], eoa_token_index=ids[EOA],
    )  # fmt: skip


def build_tiny_gemma4(folder, *, kind: str = "e", seed: int = 0) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer, processor) of `kind` to `folder`; returns it."""
    folder = Path(folder)
    tokenizer = gemma4_tokenizer()
    save_widened_random_weights(Gemma4ForConditionalGeneration, gemma4_config(tokenizer, kind), folder, seed)
    Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(feature_size=MEL_BINS),
        image_processor=Gemma4ImageProcessor(max_soft_tokens=SOFT_TOKENS),
        video_processor=Gemma4VideoProcessor(max_soft_tokens=SOFT_TOKENS, num_frames=4),
        tokenizer=tokenizer, chat_template=GEMMA4_CHAT_TEMPLATE, image_seq_length=SOFT_TOKENS,
        audio_seq_length=AUDIO_TOKENS,
    ).save_pretrained(folder)  # fmt: skip
    return folder
