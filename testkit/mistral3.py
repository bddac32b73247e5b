"""A tiny, randomly initialised Mistral 3 VLM checkpoint (Mistral3ForConditionalGeneration, Pixtral-style
vision) in Hugging Face folder format, built offline.

Vision: Pixtral, 4-pixel patches, width 32, 2 layers of 4 heads (head_dim 8), SiLU MLP (as Mistral 3.1's);
the projector merges 2x2 patches, so each image token covers 8x8 pixels. The image processor resizes an
image so that its longest edge is at most LONGEST_EDGE (48) pixels, then up to multiples of 8: an image
takes at most 6x6 `[IMG]` tokens, with `[IMG_BREAK]` after every row but the last and `[IMG_END]` after
it. Text: Mistral, hidden 32, 2 layers, 4 heads over 2 KV heads of 16, untied head. The tokenizer is the
test "llava" tokenizer with Pixtral's image tokens added as special tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import AddedToken
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    PixtralImageProcessor,
    PixtralProcessor,
    PixtralVisionConfig,
    PreTrainedTokenizerFast,
)

from .tokenizer import build_tokenizer

PATCH, MERGE, LONGEST_EDGE = 4, 2, 48
IMG, IMG_BREAK, IMG_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
MISTRAL3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '[INST]' if message['role'] == 'user' else '' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '[IMG]' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '[/INST]' if message['role'] == 'user' else eos_token }}{% endfor %}"
)


def mistral3_tokenizer() -> PreTrainedTokenizerFast:
    """The "llava" test tokenizer (BOS `<s>` prepended) with Pixtral's image tokens."""
    backend = build_tokenizer("llava").backend_tokenizer
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in (IMG, IMG_BREAK, IMG_END)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",
        chat_template=MISTRAL3_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )


def build_tiny_mistral3(folder, *, seed: int = 0) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer, processor) to `folder`; returns it."""
    folder = Path(folder)
    tokenizer = mistral3_tokenizer()
    vision = PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=LONGEST_EDGE,
        patch_size=PATCH, hidden_act="silu", rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
    )  # fmt: skip
    text = MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=len(tokenizer), max_position_embeddings=2048, sliding_window=None,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    config = Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids(IMG),
        spatial_merge_size=MERGE, projector_hidden_act="gelu", vision_feature_layer=-1, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Mistral3ForConditionalGeneration(config)
        with torch.no_grad():  # widened (HF's init leaves small weights)
            for name, param in model.named_parameters():
                if param.ndim >= 2 or "norm" in name:
                    param.normal_(0, 0.2)
        model.save_pretrained(folder, safe_serialization=True)
    image_processor = PixtralImageProcessor(
        size={"longest_edge": LONGEST_EDGE}, patch_size={"height": PATCH, "width": PATCH}
    )
    PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        chat_template=MISTRAL3_CHAT_TEMPLATE,
    ).save_pretrained(folder)
    return folder
