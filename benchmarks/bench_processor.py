"""Processor throughput: the HF processor called directly vs `apply` uncached vs `apply` all-cached.

LLaVA-1.5-shaped processor (336 px CLIP, patch 14: 576 tokens per image), 4 random 640x480
images per request. The variants take turns in blocks of --block calls (so machine noise hits
all alike, while each block runs warm, as a busy server does); the ratios are what matter. The
last line times the content hashing of the 4 images alone: the floor of any cached call, since
every request's images must be hashed to be looked up.

    .venv/bin/python -m benchmarks.bench_processor [--rounds 10] [--block 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from tessera.multimodal import MULTIMODAL_REGISTRY
from testkit import build_llava_15_shaped_processor_folder

PROMPT = "USER: <image>\n<image>\n<image>\n<image>\nWhat differs between these pictures? ASSISTANT:"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=5)
    args = parser.parse_args()

    folder = build_llava_15_shaped_processor_folder(Path(tempfile.mkdtemp()) / "llava-1.5-shaped")
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)) for _ in range(4)]
    mm_data = {"image": images}

    uncached = MULTIMODAL_REGISTRY.create_processor(folder, mm_processor_cache_gb=0)
    cached = MULTIMODAL_REGISTRY.create_processor(folder)
    hf_processor = uncached.info.get_hf_processor()
    cached.apply(PROMPT, mm_data)  # warm the cache: every later call hits all 4 items

    runs = {
        "HF processor": lambda: hf_processor(text=PROMPT, images=images, return_tensors="pt"),
        "apply, uncached": lambda: uncached.apply(PROMPT, mm_data),
        "apply, all cached": lambda: cached.apply(PROMPT, mm_data),
        "hash 4 images only": lambda: cached._hash_mm_items(cached._to_mm_items(mm_data), {}),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, fn in runs.items():
        fn()  # warm-up
    for _ in range(args.rounds):
        for name, fn in runs.items():
            for _ in range(args.block):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)

    out = cached.apply(PROMPT, mm_data)
    calls = args.rounds * args.block
    print(f"{len(out['prompt_token_ids'])} prompt tokens, 4 images of 640x480, median of {calls} calls each")
    base = statistics.median(times["HF processor"])
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:<19} {median * 1e3:8.2f} ms   {base / median:6.1f}x vs HF processor")
    print(f"cache hit rate {cached.cache.stats.hit_rate:.2f}; goal: all-cached >= 20x faster than HF processor")


if __name__ == "__main__":
    main()
