"""A tiny, randomly initialised Gemma 3 VLM checkpoint (Gemma3ForConditionalGeneration) in Hugging Face
folder format, built offline.

Vision: SigLIP without its pooling head, 32-pixel images of 8-pixel patches (4x4 patches), width 32, 2
layers; the projector average-pools the 4x4 grid to 2x2, so each image (and each pan-and-scan crop) takes
MM_TOKENS_PER_IMAGE = 4 `<image_soft_token>` embeddings. Text: Gemma 3, hidden 32, 3 layers (sliding,
full, sliding; window 6), 4 heads over 2 KV heads of 16. The tokenizer is the test "llava" tokenizer with
Gemma 3's image tokens added as special tokens (`<start_of_image>`, `<image_soft_token>`,
`<end_of_image>`), named as the processor wants them (boi_token, image_token, eoi_token). The image
processor resizes to 32x32; pan-and-scan (off unless asked for) cuts crops of at least 16 pixels, up to 3.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessor,
    Gemma3Processor,
    Gemma3TextConfig,
    PreTrainedTokenizerFast,
    SiglipVisionConfig,
)

from .tokenizer import build_tokenizer

IMAGE_SIZE, PATCH, MM_TOKENS_PER_IMAGE, SLIDING_WINDOW = 32, 8, 4, 6
BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
PAN_AND_SCAN = dict(pan_and_scan_min_crop_size=16, pan_and_scan_max_num_crops=3, pan_and_scan_min_ratio_to_activate=1.2)
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)


def gemma3_tokenizer() -> PreTrainedTokenizerFast:
    """The "llava" test tokenizer (BOS `<s>` prepended) with Gemma 3's image tokens."""
    base = build_tokenizer("llava")
    backend = base.backend_tokenizer
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in (BOI, IMAGE, EOI)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",
        extra_special_tokens={"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI},
        chat_template=GEMMA3_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )


def build_tiny_gemma3(folder, *, seed: int = 0) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer, processor) to `folder`; returns it."""
    folder = Path(folder)
    tokenizer = gemma3_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (BOI, IMAGE, EOI)}
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE_SIZE,
        patch_size=PATCH, vision_use_head=False, layer_norm_eps=1e-6,
    )  # fmt: skip
    text = Gemma3TextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=16, sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], vocab_size=len(tokenizer),
        max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=MM_TOKENS_PER_IMAGE,
        boi_token_index=ids[BOI], eoi_token_index=ids[EOI], image_token_index=ids[IMAGE],
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Gemma3ForConditionalGeneration(config)
        with torch.no_grad():  # widened (HF's init leaves small weights and zero norms and projection)
            for name, param in model.named_parameters():
                if param.ndim >= 2 or "norm" in name:
                    param.normal_(0, 0.2)
        model.save_pretrained(folder, safe_serialization=True)
    image_processor = Gemma3ImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False, **PAN_AND_SCAN
    )
    Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=MM_TOKENS_PER_IMAGE,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    ).save_pretrained(folder)
    return folder
