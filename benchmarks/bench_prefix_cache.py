"""Prefix cache: time to first token for a repeated image + prompt, cold vs warm.

The warm request finds its prompt's KV blocks (tokens and image) already computed, so it skips
the vision encoder and all but the last prompt token. A third request with the same text and a
different image shows that only identical images share blocks (it is cold again).

    .venv/bin/python -m benchmarks.bench_prefix_cache [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from PIL import Image

from benchmarks.bench_model import bench_model
from tessera import LLM, SamplingParams

PROMPT = "USER: <image>\nDescribe this picture in detail, please. ASSISTANT:"


def ttft(llm: LLM, image: Image.Image) -> float:
    (output,) = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}},
                             SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)  # fmt: skip
    return output.outputs[0].metrics.time_to_first_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(str(bench_model()), kv_cache_memory="1GiB")
    rng = np.random.default_rng(0)
    cold, warm, other = [], [], []
    for _ in range(args.repeats):
        image = Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))
        cold.append(ttft(llm, image))
        warm.append(ttft(llm, image))
        other.append(ttft(llm, Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))))
    c, w, o = (statistics.median(x) for x in (cold, warm, other))
    print(f"time to first token, median of {args.repeats}:")
    print(f"  cold (new image)              {c * 1e3:8.1f} ms")
    print(f"  warm (same image and prompt)  {w * 1e3:8.1f} ms   {c / w:5.1f}x faster  (goal >= 10x)")
    print(f"  same prompt, other image      {o * 1e3:8.1f} ms   (no sharing across images)")
    print(f"prefix-cache hit rate {llm.engine.core.block_manager.prefix_hit_rate:.2f}")


if __name__ == "__main__":
    main()
