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
    quantized(args.rows, args.runs, bandwidth, isas)


def quantized(row_counts: list[int], runs: int, bandwidth: float, isas: list[int]) -> None:
    """int8 (groups of 32, and per channel) and int4 (groups of 32) weights with bfloat16 scales through the native
    kernels (int16 dot products: AVX512-VNNI, else AVX2), against the bfloat16 weights' best native kernel and torch's int8 / int4 ops (what the engine ran
    before), bfloat16 x. Prints ms per pass over all layers, the read rate of the bytes each streams, and the
    speed-up over bfloat16."""
    from tessera.layers.int4_kernels import int4_mm, pack_int4
    from tessera.layers.quantization import quantize_int4, quantize_int8

    weights = [torch.randn(n, k).bfloat16() for _ in range(LAYERS) for n, k in SHAPES]
    dense = [nk.pack(w) for w in weights]
    int8, int8_channel, int4, torch_int8, torch_int4 = [], [], [], [], []
    for w in weights:
        q, scale = quantize_int8(w, group_size=32)
        int8.append(nk.pack_int8(q, scale))
        q, scale = quantize_int8(w)
        int8_channel.append(nk.pack_int8(q, scale))
        torch_int8.append((q, scale))
        q4, scales_and_zeros = quantize_int4(w)
        int4.append(nk.pack_int4(q4, scales_and_zeros[..., 0].t(), scales_and_zeros[..., 1].t()))
        torch_int4.append((pack_int4(q4, op_layout=True), scales_and_zeros))

    def nbytes(packs) -> int:
        return sum(t.numel() * t.element_size() for pack in packs for t in (pack if isinstance(pack, tuple) else (pack,)))

    for rows in row_counts:
        xs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES}
        kernels = {"bf16 native": (lambda: [nk.linear(xs[w.shape[1]], p, w.shape[0]) for w, p in zip(weights, dense)], dense)}
        for isa in sorted({nk.ISA_AVX2, nk.quant_isa()}):
            tag = nk.ISA_NAMES[isa]
            for name, packs in (("int8/32", int8), ("int8/channel", int8_channel)):
                kernels[f"{name} {tag}"] = (
                    lambda packs=packs, isa=isa: [
                        torch.ops.tessera.gemv_int8(xs[w.shape[1]], q, s, w.shape[0], None, isa)
                        for w, (q, s) in zip(weights, packs)
                    ],
                    packs,
                )
            kernels[f"int4/32 {tag}"] = (
                lambda isa=isa: [
                    torch.ops.tessera.gemv_int4(xs[w.shape[1]], q, s, w.shape[0], None, isa)
                    for w, (q, s) in zip(weights, int4)
                ],
                int4,
            )
        kernels["torch int8 op"] = (
            lambda: [torch.ops.aten._weight_int8pack_mm(xs[w.shape[1]], q, s) for w, (q, s) in zip(weights, torch_int8)],
            torch_int8,
        )
        kernels["torch int4 op"] = (lambda: [int4_mm(xs[w.shape[1]], q, sz) for w, (q, sz) in zip(weights, torch_int4)], torch_int4)
        times = {name: [] for name in kernels}
        for _ in range(runs):
            for name, (fn, _) in kernels.items():
                times[name].append(seconds(fn))
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians["bf16 native"]
        cells = ", ".join(
            f"{name} {t * 1e3:.2f} ms {nbytes(kernels[name][1]) / t / 1e9:.1f} GB/s ({nbytes(kernels[name][1]) / t / bandwidth:.2f}) "
            f"{base / t:.2f}x"
            for name, t in medians.items()
        )
        print(f"quantized x {rows:>2} rows (bf16 x; speed-up over bf16 native): {cells}")


if __name__ == "__main__":
    main()
