"""Releasing KV blocks out of every layer's window: throughput and preemptions, freeing on vs off.

A Mistral-shaped random model whose every layer has a sliding window (hidden 256, 4 layers, 4 heads
over 2 KV heads, window 64), 16 requests with ~100-token prompts and 256 output tokens (ignore EOS),
and a KV cache that holds only part of their full contexts. With freeing on, a sequence holds about
its window's blocks while it decodes, so more run at once and fewer are preempted (recomputed). Both
engines run in one process, alternately; the medians of the repeats are printed side by side.

    .venv/bin/python -m benchmarks.bench_window_blocks [--repeats 3] [--kv-cache-tokens 1536]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from transformers import MistralConfig, MistralForCausalLM

from tessera import LLM, SamplingParams
from testkit import build_tiny_text_model

NUM_REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS, WINDOW, BLOCK_SIZE = 16, 100, 256, 64, 16
SHAPE = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    sliding_window=WINDOW, max_position_embeddings=1024,
)  # fmt: skip
DEFAULT_FOLDER = Path("/tmp/tessera-bench-mistral-window64")
BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4  # k and v, 4 layers, 2 KV heads of 64, fp32


def bench_model(folder: Path = DEFAULT_FOLDER) -> Path:
    if not (folder / "model.safetensors").is_file():
        build_tiny_text_model(folder, MistralForCausalLM, MistralConfig, **SHAPE)
    return folder


def workload(vocab_size: int) -> list[dict]:
    rng = np.random.default_rng(0)  # distinct prompts of 90-110 tokens: no prefix-cache hits between them
    lengths = rng.integers(PROMPT_TOKENS - 10, PROMPT_TOKENS + 11, NUM_REQUESTS)
    return [{"prompt_token_ids": rng.integers(10, vocab_size, n).tolist()} for n in lengths]


def run(llm: LLM, prompts: list[dict]) -> tuple[float, int, int, float]:
    """(output tokens/s, preemptions, peak and mean running sequences) of one pass over the workload."""
    engine = llm.engine
    engine.core.scheduler.reset()
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    peak, tokens, running = 0, 0, []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        running.append(len(engine.core.scheduler.running) + sum(o.finished for o in outputs))  # those the step ran
        for output in outputs:
            if output.finished:
                tokens += len(output.outputs[0].token_ids)
        peak = max(peak, running[-1])
    elapsed = time.perf_counter() - start
    assert tokens == NUM_REQUESTS * OUTPUT_TOKENS
    return tokens / elapsed, engine.core.scheduler.num_preemptions, peak, statistics.mean(running)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-tokens", type=int, default=1536, help="KV cache size, in tokens")
    args = parser.parse_args()
    folder = bench_model()
    options = dict(kv_cache_memory=args.kv_cache_tokens * BYTES_PER_TOKEN, block_size=BLOCK_SIZE)
    llms = {free: LLM(str(folder), free_out_of_window_blocks=free, **options) for free in (True, False)}
    prompts = workload(llms[True].engine.model_config.hf_config.vocab_size)
    full = sum(len(p["prompt_token_ids"]) + OUTPUT_TOKENS for p in prompts)
    print(f"{NUM_REQUESTS} requests, ~{PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens, window {WINDOW}; "
          f"KV cache {llms[True].engine.core.num_blocks * BLOCK_SIZE} tokens for {full} of full contexts")  # fmt: skip
    results: dict[bool, list[tuple[float, int, int, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for free, llm in llms.items():
            results[free].append(run(llm, prompts))
    medians = {free: [statistics.median(r[i] for r in rs) for i in range(4)] for free, rs in results.items()}
    print(f"median of {args.repeats}:   output tok/s   preemptions   peak running   mean running per step")
    for free in (False, True):
        tps, preemptions, peak, mean = medians[free]
        print(f"  freeing {'on ' if free else 'off'}   {tps:12.1f}   {preemptions:11.0f}   {peak:12.0f}   {mean:21.1f}")
    (on_tps, on_pre, on_peak, on_mean), (off_tps, off_pre, off_peak, off_mean) = medians[True], medians[False]
    print(f"on / off: throughput {on_tps / off_tps:.2f}x, peak running {on_peak / off_peak:.2f}x, "
          f"mean running {on_mean / off_mean:.2f}x, preemptions {on_pre:.0f} vs {off_pre:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
