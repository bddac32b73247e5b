"""The benchmark model: a random-weight LLaVA of realistic shape, built offline once.

CLIP ViT-B/16 at 224 px (196 image tokens) + a SmolLM2-135M-shaped Llama (hidden 576, 30 layers,
9 heads, 3 KV heads, intermediate 1536, vocab 49152, tied embeddings).
"""

from __future__ import annotations

import time
from pathlib import Path

from tessera.testing import build_tiny_llava

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


if __name__ == "__main__":
    print(bench_model())
