"""Tensor parallelism (TP=2) and data-parallel replicas (DP=2) against one process, on this machine.

Model: a random-weight LLaVA (CLIP ViT-B/16 at 224 px) over a Qwen2.5-0.5B-shaped Llama (hidden 896, 24
layers, 14 heads over 2 KV heads: both split in two; vocab 151936, tied), float32. Workloads:
- latency: one request with an image, 64 output tokens: time to first token and decode tokens/s;
- throughput: 16 requests, a distinct image each, 64 output tokens each (ignore EOS): output tokens/s.
TP=1 and TP=2 engines live side by side and run in alternating rounds; DP=2 (two core processes behind one
AsyncEngine, its LLMEngine driving a DataParallelClient) is timed against one in-process AsyncEngine on the
throughput workload.
Prints medians over the rounds and the ratios to one process.

    .venv/bin/python -m benchmarks.bench_parallel [--rounds 3] [--skip-dp]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_model import VISION
from tessera import LLM, SamplingParams
from testkit import random_images

TEXT_TP = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096,
)  # fmt: skip
FOLDER = Path("/tmp/tessera-bench-llava-b16-qwen05b-shaped")
NUM_REQUESTS, OUTPUT_TOKENS = 16, 64
OPTIONS = dict(dtype="float32", kv_cache_memory="1GiB")


def model_folder() -> Path:
    from testkit import build_tiny_llava

    if not (FOLDER / "model.safetensors").is_file():
        start = time.perf_counter()
        build_tiny_llava(FOLDER, image_size=224, patch_size=16, vision_overrides=VISION, text_overrides=TEXT_TP)
        print(f"built {FOLDER} in {time.perf_counter() - start:.0f} s", flush=True)
    return FOLDER


def prompts(n: int, seed: int) -> list[dict]:
    images = random_images([(640, 480)] * n, seed=seed)
    return [{"prompt": f"USER: <image>\nWhat is in picture {i}? ASSISTANT:", "multi_modal_data": {"image": image}}
            for i, image in enumerate(images)]  # fmt: skip


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def latency(llm: LLM, seed: int) -> tuple[float, float]:
    """(time to first token in s, decode tokens/s after it) of one request, on a fresh image."""
    request = prompts(1, seed)[0]
    start = time.perf_counter()
    llm.generate(request, greedy(1), use_tqdm=False)
    ttft = time.perf_counter() - start
    request = prompts(1, seed + 1000)[0]
    start = time.perf_counter()
    llm.generate(request, greedy(OUTPUT_TOKENS + 1), use_tqdm=False)
    total = time.perf_counter() - start
    return ttft, OUTPUT_TOKENS / max(total - ttft, 1e-9)


def throughput(llm: LLM, seed: int) -> float:
    batch = prompts(NUM_REQUESTS, seed)
    start = time.perf_counter()
    outputs = llm.generate(batch, greedy(OUTPUT_TOKENS), use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def bench_tensor_parallel(folder: Path, rounds: int) -> None:
    engines = {size: LLM(str(folder), tensor_parallel_size=size, **OPTIONS) for size in (1, 2)}
    for llm in engines.values():  # warm-up: first-call allocations, oneDNN primitive caches
        llm.generate(prompts(2, 99), greedy(4), use_tqdm=False)
    results = {size: {"ttft": [], "decode": [], "throughput": []} for size in engines}
    for round_ in range(rounds):
        for size, llm in engines.items():
            # torch's thread count is per process: rank 0 of TP=2 takes its share (cores / 2), TP=1 all cores
            workers = llm.engine.core.workers
            torch.set_num_threads(workers.num_threads if workers else os.cpu_count() or 1)
            ttft, decode = latency(llm, seed=10 * round_ + size)
            results[size]["ttft"].append(ttft)
            results[size]["decode"].append(decode)
            results[size]["throughput"].append(throughput(llm, seed=100 * round_ + size))
            print(f"round {round_} TP={size}: TTFT {ttft * 1000:.0f} ms, decode {decode:.1f} tok/s, "
                  f"16 requests {results[size]['throughput'][-1]:.1f} tok/s", flush=True)  # fmt: skip
    for llm in engines.values():
        llm.shutdown()
    med = {size: {k: statistics.median(v) for k, v in r.items()} for size, r in results.items()}
    print("\nTensor parallelism, medians of", rounds, "rounds:")
    print(f"{'':>6} {'TTFT ms':>9} {'decode tok/s':>13} {'16 req tok/s':>13}")
    for size in (1, 2):
        m = med[size]
        print(f"TP={size:<3} {m['ttft'] * 1000:9.0f} {m['decode']:13.1f} {m['throughput']:13.1f}")
    one, two = med[1], med[2]
    print(f"TP=2 / TP=1: TTFT x{one['ttft'] / two['ttft']:.2f} (above 1: faster), "
          f"decode x{two['decode'] / one['decode']:.2f}, throughput x{two['throughput'] / one['throughput']:.2f}")


async def engine_throughput(engine, seed: int) -> float:
    """Output tokens/s of NUM_REQUESTS requests sent at once to an AsyncEngine (one core in-thread, or two
    data-parallel replicas)."""

    async def one(i: int, prompt: dict) -> int:
        stream = await engine.add_request(f"bench-{seed}-{i}", prompt, greedy(OUTPUT_TOKENS))
        final = None
        async for output in stream:
            final = output
        return len(final.outputs[0].token_ids)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(NUM_REQUESTS, seed))))
    return sum(counts) / (time.perf_counter() - start)


async def bench_data_parallel(folder: Path, rounds: int) -> None:
    from tessera.engine.async_engine import AsyncEngine
    from tessera.engine.llm_engine import LLMEngine

    engines = {
        1: AsyncEngine(LLMEngine.from_options(str(folder), **OPTIONS)),
        2: AsyncEngine(LLMEngine.data_parallel(str(folder), OPTIONS, 2)),
    }
    try:
        for engine in engines.values():
            await engine_throughput(engine, seed=99)
        results: dict[int, list[float]] = {size: [] for size in engines}
        for round_ in range(rounds):
            for size, engine in engines.items():
                results[size].append(await engine_throughput(engine, seed=100 * round_ + size))
                print(f"round {round_} DP={size}: 16 requests {results[size][-1]:.1f} tok/s", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    one, two = statistics.median(results[1]), statistics.median(results[2])
    print(f"\nData parallelism, medians of {rounds} rounds: one engine {one:.1f} tok/s, two replicas {two:.1f} tok/s, "
          f"x{two / one:.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-dp", action="store_true")
    parser.add_argument("--skip-tp", action="store_true")
    args = parser.parse_args()
    folder = model_folder()
    if not args.skip_tp:
        bench_tensor_parallel(folder, args.rounds)
    if not args.skip_dp:
        asyncio.run(bench_data_parallel(folder, args.rounds))


if __name__ == "__main__":
    main()
