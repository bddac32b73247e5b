"""Decode roofline: batch-1 decode reads every language-model weight once per token, so its
speed is bounded by memory bandwidth. Prints decode tokens/s x weight bytes / measured read
bandwidth (goal >= 0.6).

    .venv/bin/python -m benchmarks.bench_decode_roofline [--tokens 64]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.bench_model import bench_model
from tessera import LLM, SamplingParams


def read_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Bytes/s of summing a buffer far larger than the caches (best of a few). Random values: the pages of a
    constant buffer are all alike, and the host may merge them (same-page merging), which then reads from cache
    (a `torch.ones` buffer read at 52-57 GB/s on a machine that streams ~32)."""
    buffer = torch.rand(num_bytes // 4, generator=torch.Generator().manual_seed(0))
    buffer.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    bandwidth = read_bandwidth()
    llm = LLM(str(bench_model()), kv_cache_memory="1GiB", dtype=args.dtype)
    # Every weight is read once per token; the tied embedding once (as lm_head; the lookup reads a
    # row). Counted on the meta device: the engine keeps its linears packed, not dense.
    with torch.device("meta"):
        lm = type(llm.engine.core.model)(llm.engine.model_config.hf_config).language_model
    weight_bytes = (
        sum(p.numel() for p in lm.parameters()) * torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    )
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate("USER: Tell me a long story about a lighthouse. ASSISTANT:", params, use_tqdm=False)
    metrics = output.outputs[0].metrics
    tokens_per_s = 1 / metrics.time_per_output_token
    print(f"batch-1 decode {tokens_per_s:.1f} tokens/s; language-model weights {weight_bytes / 2**20:.0f} MiB")
    print(f"measured read bandwidth {bandwidth / 1e9:.1f} GB/s -> roofline {bandwidth / weight_bytes:.1f} tokens/s")
    print(f"decode roofline fraction {tokens_per_s * weight_bytes / bandwidth:.2f}  (goal >= 0.6)")


if __name__ == "__main__":
    main()
