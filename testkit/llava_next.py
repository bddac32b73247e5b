"""Tiny, randomly initialised LLaVA-NeXT and LLaVA-OneVision checkpoints in Hugging Face folder format, built offline.

LLaVA-NeXT (llava-hf/llava-v1.6-* scaled down): CLIP tower 32 px, 8-px patches (16 features a tile), the
hub's five anyres grids scaled to 32-px tiles (1x2, 2x1, 2x2, 3x1, 1x3 tiles), "default" strategy, layer -2;
a Llama decoder (hidden 32, 2 layers, 4 heads over 2 KV heads) with the "llava" test tokenizer.

LLaVA-OneVision (llava-hf/llava-onevision-qwen2-*-hf scaled down): SigLIP tower 32 px, 8-px patches, no
head, "full" strategy, layer -1; every grid from 1x1 to 4x4 tiles with "anyres_max_9" (so 4x4-tile
features get downscaled); videos resized to 32 px, 2x2-pooled (4 tokens a frame) plus one newline; a Qwen2
decoder with the "qwen" test tokenizer and ``<image>`` / ``<video>`` added as special tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaNextProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessor,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
    MistralConfig,
    Qwen2Config,
    SiglipVisionConfig,
)
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling

from .tokenizer import LLAVA_CHAT_TEMPLATE, build_tokenizer

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
TILE, PATCH = 32, 8
NEXT_GRID_PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]  # (height, width), as the hub's 336-px ones
ONEVISION_GRID_PINPOINTS = [[TILE * i, TILE * j] for i in range(1, 5) for j in range(1, 5)]
ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>\\n' }}{% elif part['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _save(model_class, config, folder: Path, seed: int) -> None:
    """Random weights widened (HF's init leaves small ones, so outputs would hardly depend on the images),
    saved with the CLIP / SigLIP tower in the hub's layout (transformers 5 drops its "vision_model." level)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.ndim >= 2 and "norm" not in name:
                    param.normal_(0, 0.2)
        model.save_pretrained(folder, safe_serialization=True)
    path = folder / "model.safetensors"
    old, new = "vision_tower.", "vision_tower.vision_model."
    tensors = load_file(path)
    renamed = {new + k[len(old) :] if k.startswith(old) else k: v for k, v in tensors.items()}
    save_file(renamed, path, metadata={"format": "pt"})


def _text_settings(tokenizer, **ids) -> dict:
    return dict(
        TINY, num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=4096, **ids
    )  # fmt: skip


def build_tiny_llava_next(folder, *, text_model: str = "llama", seed: int = 0) -> Path:
    """LLaVA-NeXT layout: CLIP -> projector, anyres tiles unpadded with a newline per row -> Llama (or
    Mistral: `text_model="mistral"`, as llava-v1.6-mistral)."""
    folder = Path(folder)
    tokenizer = build_tokenizer("llava")
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    config = LlavaNextConfig(
        vision_config=CLIPVisionConfig(**TINY, image_size=TILE, patch_size=PATCH, projection_dim=32),
        text_config={"llama": LlamaConfig, "mistral": MistralConfig}[text_model](**_text_settings(tokenizer, **ids)),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_grid_pinpoints=NEXT_GRID_PINPOINTS,
        image_seq_length=(TILE // PATCH) ** 2,
        pad_token_id=tokenizer.pad_token_id,
    )
    _save(LlavaNextForConditionalGeneration, config, folder, seed)
    image_processor = LlavaNextImageProcessor(  # as llava-hf/llava-v1.6-mistral-7b-hf's, scaled to 32 px
        size={"shortest_edge": TILE},
        crop_size={"height": TILE, "width": TILE},
        image_grid_pinpoints=NEXT_GRID_PINPOINTS,
        resample=PILImageResampling.BICUBIC,
        do_center_crop=True,
        do_pad=True,
        image_mean=OPENAI_CLIP_MEAN,
        image_std=OPENAI_CLIP_STD,
    )
    LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=LLAVA_CHAT_TEMPLATE,
    ).save_pretrained(folder)
    return folder


def build_tiny_llava_onevision(folder, *, seed: int = 0) -> Path:
    """LLaVA-OneVision layout: SigLIP -> projector, anyres_max_9 tiles (unpadded, downscaled, newline per
    row) and 2x2-pooled video frames (one newline at the end) -> Qwen2."""
    folder = Path(folder)
    tokenizer = build_tokenizer("qwen")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    ids = dict(
        bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"], pad_token_id=special["<|endoftext|>"]
    )
    config = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**TINY, image_size=TILE, patch_size=PATCH, vision_use_head=False),
        text_config=Qwen2Config(**_text_settings(tokenizer, **ids)),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_9",
        image_grid_pinpoints=ONEVISION_GRID_PINPOINTS,
        pad_token_id=ids["pad_token_id"],
    )
    _save(LlavaOnevisionForConditionalGeneration, config, folder, seed)
    siglip = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], resample=PILImageResampling.BICUBIC)
    LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(
            size={"height": TILE, "width": TILE}, image_grid_pinpoints=ONEVISION_GRID_PINPOINTS, do_pad=True, **siglip
        ),
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(size={"height": TILE, "width": TILE}, **siglip),
        num_image_tokens=(TILE // PATCH) ** 2,
        vision_feature_select_strategy="full",
        image_token="<image>",
        video_token="<video>",
        vision_aspect_ratio="anyres_max_9",
        chat_template=ONEVISION_CHAT_TEMPLATE,
    ).save_pretrained(folder)
    return folder
