"""A tiny, randomly initialised LFM2-VL checkpoint in Hugging Face folder format, built offline.

Text: LFM2, hidden 32, 4 layers (conv, attention, conv, attention), 4 heads over 2 KV heads. Vision: SigLIP2
NaFlex, width 32, 2 layers, 2 heads, 4-pixel patches, a 4 x 4 learned position grid resized to each tile.
Projector: pixel unshuffle by 2, layer norm, 2 linears. The image processor works at a small scale: 32-pixel
tiles (8 x 8 patches: 16 tokens each), 4 to 16 tokens for a whole image or the thumbnail, 2 to 4 tiles for
images over 2 x 16 tokens' pixels. The tokenizer is the Qwen-VL test tokenizer with LFM2-VL's image tokens.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken
from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration, Lfm2VlImageProcessor, Lfm2VlProcessor

from .checkpoints import save_widened_random_weights
from .tokenizer import CHATML_TEMPLATE, build_tokenizer

MAX_TILES = 4
IMAGE_TOKENS = ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"] + [
    f"<|img_row_{r}_col_{c}|>" for r in range(1, MAX_TILES + 1) for c in range(1, MAX_TILES + 1)
]
IMAGE_PROCESSING = dict(
    encoder_patch_size=4, tile_size=32, downsample_factor=2, min_image_tokens=4, max_image_tokens=16, min_tiles=2,
    max_tiles=MAX_TILES, max_num_patches=64,
)  # fmt: skip


def build_tiny_lfm2_vl(folder, *, seed: int = 0) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer, processor) to `folder`; returns it."""
    tokenizer = build_tokenizer("qwen")
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(t, normalized=False) for t in IMAGE_TOKENS]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<image>", "<|im_end|>", "<|endoftext|>")}
    text = dict(
        model_type="lfm2", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention", "conv", "full_attention"],
        conv_L_cache=3, max_position_embeddings=1024, norm_eps=1e-5, bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )  # fmt: skip
    vision = dict(
        model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, patch_size=4, num_patches=16, vision_use_head=False,
    )  # fmt: skip
    config = Lfm2VlConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<image>"], projector_hidden_size=48,
        downsample_factor=2, tie_word_embeddings=True,
    )  # fmt: skip
    folder = Path(folder)
    save_widened_random_weights(Lfm2VlForConditionalGeneration, config, folder, seed)
    processor = Lfm2VlProcessor(
        image_processor=Lfm2VlImageProcessor(**IMAGE_PROCESSING), tokenizer=tokenizer, chat_template=CHATML_TEMPLATE
    )
    processor.save_pretrained(folder)
    return folder
