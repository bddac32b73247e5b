"""Qwen2.5-VL generation throughput: Tessera vs Hugging Face transformers `generate`, in one process.

Model (random weights, built offline once; see bench_model.py): the Qwen2.5-VL-3B vision tower's
shape (hidden 1280, SwiGLU 3420, 16 heads, patch 14, merge 2, temporal patch 2, window 112 px =
8x8 patches) at depth 4 instead of 32, blocks 0-2 windowed and block 3 full attention (the 3B model
ends every group of 8 blocks with a full-attention one); a Qwen2.5-0.5B-shaped Qwen2 backbone
(hidden 896, 14 heads over 2 KV heads, SwiGLU 4864, vocab 151936, tied embeddings) at 8 of its 24
layers; the 3B model's image processor (3136 to 12845056 pixels), so a 640x480 image is resized to
644x476 by HF's smart_resize: 46x34 patches, 391 image tokens.

Workload: 16 requests, one distinct random 640x480 image each in a one-turn chat prompt (423
prompt tokens), 64 output tokens each, greedy, EOS ignored. HF runs batched with left padding at
batch 8 and 16 (--hf-batches; batch 4 ran at about half of batch 16's rate in a trial, so it is left
out by default). FLOPs: vision ~4.6 T (68%), prefill ~1.7 T (24%), decode ~0.5 T (8%); the layer
counts and 64 output tokens keep one run at roughly 5-8 minutes on 2 CPU cores in float32 (the
engine's start-up profile run and the three generation passes). Prints output tokens/s, the ratio
to HF's best, and how far Tessera's greedy tokens agree with each HF run's, so that both did the
same work.

    .venv/bin/python -m benchmarks.bench_qwen_vl [--dtype float32|bfloat16] [--hf-batches 8 16]
        [--output-tokens 64]
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from benchmarks.bench_model import bench_qwen_vl_model
from benchmarks.bench_throughput import matmul_flops_per_second, time_hf_generate
from tessera import LLM, SamplingParams
from testkit import random_images

NUM_REQUESTS = 16
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# The engine's start-up profile run encodes the largest image (and video) the processor allows: at
# the 3B model's 12845056 pixels that is 65536 patches with full attention, ~9 minutes on 2 CPU cores.
# So the engine runs with mm_processor_kwargs={"max_pixels": 1280 * 28 * 28} (at most 1280 merged
# tokens an image, a common Qwen2.5-VL serving setting); a 640x480 image (306544 pixels after smart_resize) is far
# below either bound, so Tessera and HF see the same 391 image tokens.
MAX_PIXELS = 1280 * 28 * 28


def workload() -> tuple[list[str], list]:
    images = random_images([(640, 480)] * NUM_REQUESTS)
    prompts = [
        f"<|im_start|>user\n{IMAGE}What is in picture {i}?<|im_end|>\n<|im_start|>assistant\n"
        for i in range(NUM_REQUESTS)
    ]
    return prompts, images


def run_tessera(folder: Path, dtype: str, output_tokens: int) -> tuple[float, list[list[int]], int]:
    """(seconds, the output token ids of each request, the first prompt's length)."""
    prompts, images = workload()
    llm = LLM(str(folder), dtype=dtype, kv_cache_memory="2GiB", limit_mm_per_prompt={"video": 0},
              mm_processor_kwargs={"max_pixels": MAX_PIXELS})  # fmt: skip
    requests = [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)]
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert all(len(t) == output_tokens for t in tokens)
    return elapsed, tokens, len(outputs[0].prompt_token_ids)


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """How many requests agree on every token, and the shortest common prefix."""
    prefixes = []
    for a, b in zip(ours, theirs):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(n)
    identical = sum(n == len(a) for n, a in zip(prefixes, ours))
    return f"{identical}/{len(ours)} identical, shortest common prefix {min(prefixes)}/{len(ours[0])} tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hf-batches", type=int, nargs="*", default=[8, 16])
    parser.add_argument("--output-tokens", type=int, default=64)
    args = parser.parse_args()
    torch_dtype = getattr(torch, args.dtype)
    folder = bench_qwen_vl_model()
    total_tokens = NUM_REQUESTS * args.output_tokens

    elapsed, tessera_tokens, prompt_len = run_tessera(folder, args.dtype, args.output_tokens)
    gc.collect()
    results = {"Tessera": total_tokens / elapsed}
    agreements = {}
    if args.hf_batches:
        from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch_dtype).eval()
        processor = AutoProcessor.from_pretrained(folder)
        prompts, images = workload()
        image_tokens = processor(text=prompts[:1], images=images[:1])["input_ids"][0].count(
            processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        )
        print(f"{image_tokens} image tokens per 640x480 image", flush=True)
        for batch in args.hf_batches:
            seconds, hf_tokens = time_hf_generate(
                model, processor, prompts, images, torch_dtype, batch, args.output_tokens
            )  # fmt: skip
            name = f"HF generate, batch {batch}"
            results[name] = total_tokens / seconds
            agreements[name] = agreement(tessera_tokens, hf_tokens)
            print(f"  {name:<22} {results[name]:7.1f} output tokens/s", flush=True)
        del model
        gc.collect()
    peak = matmul_flops_per_second(torch_dtype)

    hf_best = max((v for k, v in results.items() if k.startswith("HF")), default=float("nan"))
    print(f"{NUM_REQUESTS} requests x {args.output_tokens} output tokens, prompt {prompt_len} tokens, {args.dtype}")
    print(f"matmul peak here {peak / 1e9:.0f} GFLOP/s")
    for name, tokens_per_s in results.items():
        line = f"  {name:<22} {tokens_per_s:7.1f} output tokens/s   {tokens_per_s / hf_best:5.2f}x HF best"
        print(line + (f"   greedy vs Tessera: {agreements[name]}" if name in agreements else ""))
    print(f"Tessera vs HF best: {results['Tessera'] / hf_best:.2f}x  (goal >= 2)")


if __name__ == "__main__":
    main()
