"""The benchmark models: random weights of realistic shape, built offline once.

bench_model: CLIP ViT-B/16 at 224 px (196 image tokens) + a SmolLM2-135M-shaped Llama (hidden 576,
30 layers, 9 heads, 3 KV heads, intermediate 1536, vocab 49152, tied embeddings).

bench_qwen_vl_model: Qwen2.5-VL with the 3B model's vision tower at 4 of its 32 layers (window
attention in blocks 0-2, full attention in block 3, as the 3B model ends each group of 8 with one) +
a Qwen2.5-0.5B-shaped Qwen2 backbone at 8 of its 24 layers (hidden 896, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings); the 3B model's image processor (patch 14, merge 2,
3136 to 12845056 pixels).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from testkit import build_tiny_llava, build_tokenizer

VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
TEXT = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
DEFAULT_FOLDER = Path("/tmp/tessera-bench-llava-b16-smollm135m")


def bench_model(folder: Path = DEFAULT_FOLDER) -> Path:
    if not (folder / "model.safetensors").is_file():
        start = time.perf_counter()
        build_tiny_llava(folder, image_size=224, patch_size=16, vision_overrides=VISION, text_overrides=TEXT)
        print(f"built {folder} in {time.perf_counter() - start:.0f} s", flush=True)
    return folder


QWEN_VISION = dict(
    depth=4, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
    temporal_patch_size=2, window_size=112, fullatt_block_indexes=[3], hidden_act="silu", tokens_per_second=2,
)  # fmt: skip
QWEN_TEXT = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=8, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
)  # fmt: skip
QWEN_PIXELS = dict(min_pixels=3136, max_pixels=12845056)  # Qwen2.5-VL-3B's preprocessor_config.json
QWEN_FOLDER = Path("/tmp/tessera-bench-qwen2_5_vl-3bvision4-qwen05b8")


def build_qwen_vl(folder: Path, *, vision_overrides: dict, text_overrides: dict, seed: int = 0) -> Path:
    """A random-weight Qwen2.5-VL (HF's own initialisation, seeded) with the Qwen test tokenizer, its chat
    template and special tokens, and Qwen2-VL image / video processors at the 3B model's pixel bounds."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    from testkit.tokenizer import QWEN_VL_CHAT_TEMPLATE, QWEN_VL_SPECIAL_TOKENS

    tokenizer = build_tokenizer("qwen")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_VL_SPECIAL_TOKENS}
    text = dict(
        text_overrides, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )  # fmt: skip
    vision = dict(vision_overrides, out_hidden_size=text["hidden_size"])
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, tie_word_embeddings=True, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder, safe_serialization=True)
    processing = dict(
        patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"], **QWEN_PIXELS,
    )  # fmt: skip
    Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**processing),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**processing),
        chat_template=QWEN_VL_CHAT_TEMPLATE,
    ).save_pretrained(folder)
    return folder


def bench_qwen_vl_model(folder: Path = QWEN_FOLDER) -> Path:
    if not (folder / "model.safetensors").is_file():
        start = time.perf_counter()
        build_qwen_vl(folder, vision_overrides=QWEN_VISION, text_overrides=QWEN_TEXT)
        print(f"built {folder} in {time.perf_counter() - start:.0f} s", flush=True)
    return folder


if __name__ == "__main__":
    print(bench_model())
    print(bench_qwen_vl_model())
