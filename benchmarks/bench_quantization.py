"""Batch-1 decode tokens/s of int8 and int4 weight-only quantization vs bfloat16 vs float32, side by side in one
process on the realistic LLaVA (`bench_model`: CLIP ViT-B/16 + a SmolLM2-135M-shaped Llama). The
variants take turns over `--rounds` rounds (so drifts in machine load hit all of them); each prints
its median. Also prints the language model's linear weight bytes of each variant.
Goals: int8 (bfloat16 activations) decode >= 1.8x bfloat16 decode, int4 (groups of 32) >= 3x.

    .venv/bin/python -m benchmarks.bench_quantization [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

from benchmarks.bench_model import bench_model
from tessera import LLM, SamplingParams
from tessera.layers.linear import Linear

VARIANTS = {  # name -> LLM options
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8 (float32 act.)": dict(dtype="float32", quantization="int8"),
    "int8 (bfloat16 act.)": dict(dtype="bfloat16", quantization="int8"),
    "int4 (float32 act.)": dict(dtype="float32", quantization="int4"),
    "int4 (bfloat16 act.)": dict(dtype="bfloat16", quantization="int4"),
}
PROMPT = "USER: Tell me a long story about a lighthouse. ASSISTANT:"


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights the language model's linears read per token (dense, packed, or int8/int4 + scales
    (and zeros))."""
    total = 0
    for module in model.language_model.modules():
        if not isinstance(module, Linear):
            continue
        if module.qweight is not None:
            tensors = (module.qweight, module.qscale)
        elif module.packed_weight is not None:
            tensors = (module.packed_weight,)
        elif module.native_weight is not None:
            tensors = (module.native_weight,)
        else:
            tensors = (module.weight,)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def decode_tokens_per_s(llm: LLM, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate(PROMPT, params, use_tqdm=False)
    return 1 / output.outputs[0].metrics.time_per_output_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    folder = str(bench_model())
    llms = {name: LLM(folder, kv_cache_memory="256MiB", **VARIANTS[name]) for name in args.variants}
    for llm in llms.values():
        decode_tokens_per_s(llm, 4)  # warm-up
    runs: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            runs[name].append(decode_tokens_per_s(llm, args.tokens))
            gc.collect()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print(f"batch-1 decode, {args.tokens} tokens, {torch.get_num_threads()} threads, median of {args.rounds}:")
    for name, llm in llms.items():
        mib = linear_weight_bytes(llm.engine.core.model) / 2**20
        values = " ".join(f"{v:.1f}" for v in runs[name])
        print(f"  {name:22s} {medians[name]:7.1f} tokens/s  (runs {values})  linear weights {mib:6.1f} MiB")
    pairs = [(f"{q} ({a} act.)", a) for q in ("int8", "int4") for a in ("bfloat16", "float32")]
    pairs += [("int4 (bfloat16 act.)", "int8 (bfloat16 act.)"), ("bfloat16", "float32")]
    for num, den in pairs:
        if num in medians and den in medians:
            print(f"  {num} / {den}: {medians[num] / medians[den]:.2f}x")
    for method, goal in (("int8", 1.8), ("int4", 3.0)):  # issue 37's goals
        if f"{method} (bfloat16 act.)" in medians and "bfloat16" in medians:
            ratio = medians[f"{method} (bfloat16 act.)"] / medians["bfloat16"]
            print(f"{method} / bfloat16 decode {ratio:.2f}x  (goal >= {goal}x)")


if __name__ == "__main__":
    main()
