"""Tessera's native linear kernels (tessera/layers/csrc/gemv.cpp: float32 / widened 16-bit weights per ISA,
and bfloat16 pairs by AVX512-BF16 dot products where the CPU has them) against oneDNN's packed linear
(what the engine's linears run today) and F.linear, side by side in one process: the realistic LLaVA's
language model's linears (SmolLM2-135M shape: 30 layers of q/k/v, o, gate/up, down, distinct weights, so
nothing stays in cache), for 1 to 16 rows of x. Prints each one's read rate (weight bytes / time) and its
fraction of the machine's read bandwidth (summing a 1 GiB buffer), medians of `--runs` rounds.

    .venv/bin/python -m benchmarks.bench_gemv [--runs 3] [--rows 1 2 4 8 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.bench_decode_roofline import read_bandwidth
from tessera.layers import native_kernels as nk
from tessera.layers.cpu_kernels import onednn_packs, pack_weight, packed_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): q/k/v, o, gate/up, down
LAYERS = 30


def seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    if not nk.available():
        raise SystemExit(nk.describe())
    bandwidth = read_bandwidth()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    isas = [isa for isa in (nk.ISA_AVX2, nk.ISA_AVX512) if isa <= (nk.cpu_isa() or 0)]
    print(f"{cpu}, {torch.get_num_threads()} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s; GB/s (fraction)")
    for dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(n, k).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        native = [nk.pack_gemv_weight(w) for w in weights]
        pairs = [nk.pack_bf16dot_weight(w) for w in weights] if dtype == torch.bfloat16 and nk.has_bf16_dot() else None
        onednn = [pack_weight(w, 16) for w in weights] if onednn_packs(dtype) else None
        for rows in args.rows:
            xs = {k: torch.randn(rows, k).to(dtype) for _, k in SHAPES}

            def each(kernel, packed):  # every layer's product, as one step runs them
                return lambda: [kernel(xs[w.shape[1]], p, w.shape[0]) for w, p in zip(weights, packed)]

            def widening(isa):
                return each(lambda x, p, n: torch.ops.tessera.gemv(x, p, n, None, isa), native)

            kernels = {f"native {nk.ISA_NAMES[isa]}": widening(isa) for isa in isas}
            if pairs is not None:
                kernels["native bf16-dot"] = each(nk.gemv_bf16dot, pairs)
            if onednn is not None:
                kernels["oneDNN packed"] = each(lambda x, p, n: packed_linear(x, p, None), onednn)
            kernels["F.linear"] = each(lambda x, w, n: F.linear(x, w), weights)
            rates = {name: [] for name in kernels}
            for _ in range(args.runs):  # rounds alternate the kernels, so drift hits each alike
                for name, fn in kernels.items():
                    rates[name].append(nbytes / seconds(fn))
            medians = {name: statistics.median(r) for name, r in rates.items()}
            cells = ", ".join(f"{name} {rate / 1e9:.1f} ({rate / bandwidth:.2f})" for name, rate in medians.items())
            base = medians.get("oneDNN packed", medians["F.linear"])
            best = max(v for name, v in medians.items() if name.startswith("native"))
            name = str(dtype).removeprefix("torch.")
            print(f"{name:>8} x {rows:>2} rows: {cells}; best native / baseline {best / base:.2f}x")


if __name__ == "__main__":
    main()
