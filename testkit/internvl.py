"""A tiny, randomly initialised InternVL 3 checkpoint (InternVLForConditionalGeneration, transformers' HF
format) in Hugging Face folder format, built offline.

Vision: InternViT, 32-pixel tiles of 8-pixel patches (4x4 patches plus CLS), width 32, 2 layers, 4 heads,
LayerNorm (or, with `vision_variant="rms_qk"`, RMSNorm and qk-norm); pixel shuffle with downsample ratio
0.5 turns each tile into 2x2 = IMAGE_SEQ_LENGTH tokens of width 128, which the projector maps to the text
width. Text: Qwen2, hidden 32, 2 layers, 4 heads over 2 KV heads, tied embeddings. The tokenizer is the
test "qwen" tokenizer with InternVL's `<img>`, `</img>`, `<IMG_CONTEXT>` and `<video>` added as special
tokens, named as the processor wants them (start_image_token, end_image_token, context_image_token,
video_token). The image processor (GotOcr2) tiles each image into 1 to MAX_PATCHES tiles of 32x32 plus a
thumbnail (the processor's crop_to_patches is on by default).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import (
    GotOcr2ImageProcessor,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLProcessor,
    InternVLVideoProcessor,
    InternVLVisionConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from .tokenizer import build_tokenizer

TILE, PATCH, IMAGE_SEQ_LENGTH, MAX_PATCHES = 32, 8, 4, 4
IMG_START, IMG_END, IMG_CONTEXT, VIDEO = "<img>", "</img>", "<IMG_CONTEXT>", "<video>"
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif part['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def internvl_tokenizer() -> PreTrainedTokenizerFast:
    """The "qwen" test tokenizer with InternVL's image and video tokens."""
    backend = build_tokenizer("qwen").backend_tokenizer
    tokens = (IMG_START, IMG_END, IMG_CONTEXT, VIDEO)
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in tokens])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        padding_side="left",
        extra_special_tokens={
            "start_image_token": IMG_START,
            "end_image_token": IMG_END,
            "context_image_token": IMG_CONTEXT,
            "video_token": VIDEO,
        },
        chat_template=INTERNVL_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )


def tiny_internvl_config(tokenizer, *, vision_variant: str = "layer_norm") -> InternVLConfig:
    vision = InternVLVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
        patch_size=PATCH, norm_type="rms_norm" if vision_variant == "rms_qk" else "layer_norm",
        use_qk_norm=vision_variant == "rms_qk", attention_bias=True,
    )  # fmt: skip
    text = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    return InternVLConfig(
        vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids(IMG_CONTEXT),
        image_seq_length=IMAGE_SEQ_LENGTH, downsample_ratio=0.5, tie_word_embeddings=True,
    )  # fmt: skip


def build_tiny_internvl(folder, *, seed: int = 0, vision_variant: str = "layer_norm") -> Path:
    """Write the checkpoint (config, safetensors, tokenizer, processor) to `folder`; returns it."""
    folder = Path(folder)
    tokenizer = internvl_tokenizer()
    config = tiny_internvl_config(tokenizer, vision_variant=vision_variant)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = InternVLForConditionalGeneration(config)
        with torch.no_grad():  # widened (HF's init leaves small weights, zero CLS/positions, 0.1 layer scale)
            for name, param in model.named_parameters():
                if param.ndim >= 2 or "norm" in name or "lambda" in name or "cls_token" in name:
                    param.normal_(0, 0.2)
        model.save_pretrained(folder, safe_serialization=True)
    size = {"height": TILE, "width": TILE}
    InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size=size, crop_to_patches=False, min_patches=1, max_patches=MAX_PATCHES),
        tokenizer=tokenizer,
        video_processor=InternVLVideoProcessor(size=size),
        image_seq_length=IMAGE_SEQ_LENGTH,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    ).save_pretrained(folder)
    return folder
