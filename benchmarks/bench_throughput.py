"""Generation throughput: Tessera vs Hugging Face transformers `generate`, in one process.

Workload: 16 requests, one distinct 640x480 image each, ~12 text tokens, 128 output tokens
(ignore EOS), on a random-weight LLaVA of realistic shape (see bench_model.py). HF runs
sequentially and batched (left padding) at batch 8 and 16. Prints output tokens/s, the ratio to
HF's best, and the fraction of the compute roofline: the workload's FLOPs (vision tower, prefill,
decode) over the matmul FLOP/s measured here in the same dtype.

    .venv/bin/python -m benchmarks.bench_throughput [--dtype float32|bfloat16] [--hf-batches 1 8 16]
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from benchmarks.bench_model import bench_model
from tessera import LLM, SamplingParams
from testkit import random_images

NUM_REQUESTS, OUTPUT_TOKENS = 16, 128


def workload():
    images = random_images([(640, 480)] * NUM_REQUESTS)
    prompts = [f"USER: <image>\nWhat is in picture {i}? ASSISTANT:" for i in range(NUM_REQUESTS)]
    return prompts, images


def matmul_flops_per_second(dtype: torch.dtype, rounds: int = 3) -> float:
    """The machine's attainable matmul FLOP/s: the best of several rounds of a large square and a
    model-shaped matmul (a noisy neighbour lowers a round, never raises it)."""
    best = 0.0
    for _ in range(rounds):
        for m, k, n in [(2048, 2048, 2048), (2048, 576, 1536)]:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            a @ b
            start = time.perf_counter()
            for _ in range(5):
                a @ b
            best = max(best, 5 * 2 * m * k * n / (time.perf_counter() - start))
    return best


def workload_flops(folder: Path, prompt_len: int) -> float:
    """2 x parameters per token for every matmul, plus attention scores and values. Parameter
    counts come from the model built on the meta device (the engine drops packed dense weights)."""
    from tessera.config import ModelConfig
    from tessera.models.llava import LlavaForConditionalGeneration

    config = ModelConfig(str(folder), device="cpu").hf_config
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    vision_params = sum(p.numel() for p in model.vision_tower.parameters())
    vision_params += sum(p.numel() for p in model.multi_modal_projector.parameters())
    lm = model.language_model
    layer_params = sum(p.numel() for p in lm.model.layers.parameters())
    head_params = lm.lm_head.weight.numel()
    cfg = lm.config
    attn_width = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    vcfg = config.vision_config
    vision_tokens = (vcfg.image_size // vcfg.patch_size) ** 2 + 1
    vision = 2 * vision_params * vision_tokens + 4 * vcfg.num_hidden_layers * vision_tokens**2 * vcfg.hidden_size
    prefill = 2 * layer_params * prompt_len + 2 * head_params + 2 * cfg.num_hidden_layers * prompt_len**2 * attn_width
    decode = 0.0
    for t in range(OUTPUT_TOKENS - 1):
        context = prompt_len + t + 1
        decode += 2 * (layer_params + head_params) + 4 * cfg.num_hidden_layers * context * attn_width
    return NUM_REQUESTS * (vision + prefill + decode)


def run_tessera(folder: Path, dtype: str) -> tuple[float, int]:
    prompts, images = workload()
    llm = LLM(str(folder), dtype=dtype, kv_cache_memory="2GiB")
    requests = [{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)]
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == OUTPUT_TOKENS for o in outputs)
    return elapsed, len(outputs[0].prompt_token_ids)


def time_hf_generate(model, processor, prompts, images, dtype: torch.dtype, batch_size: int, output_tokens: int):
    """HF `generate` over the requests in batches of `batch_size` (left padding, greedy, exactly
    `output_tokens` new tokens each): (seconds, the new token ids of each request)."""
    processor.tokenizer.padding_side = "left"
    new_tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        inputs = processor(text=prompts[i : i + batch_size], images=images[i : i + batch_size], padding=True,
                           return_tensors="pt")  # fmt: skip
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=output_tokens, min_new_tokens=output_tokens, do_sample=False)
        assert out.shape[1] - inputs["input_ids"].shape[1] == output_tokens
        new_tokens += out[:, inputs["input_ids"].shape[1] :].tolist()
    return time.perf_counter() - start, new_tokens


def run_hf(folder: Path, dtype: torch.dtype, batch_size: int) -> float:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(folder, torch_dtype=dtype).eval()
    processor = AutoProcessor.from_pretrained(folder)
    prompts, images = workload()
    return time_hf_generate(model, processor, prompts, images, dtype, batch_size, OUTPUT_TOKENS)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hf-batches", type=int, nargs="*", default=[1, 8, 16])
    args = parser.parse_args()
    torch_dtype = getattr(torch, args.dtype)
    folder = bench_model()
    peak = matmul_flops_per_second(torch_dtype)
    total_tokens = NUM_REQUESTS * OUTPUT_TOKENS

    elapsed, prompt_len = run_tessera(folder, args.dtype)
    gc.collect()
    flops = workload_flops(folder, prompt_len)
    results = {"Tessera": total_tokens / elapsed}
    for batch in args.hf_batches:
        results[f"HF generate, batch {batch}"] = total_tokens / run_hf(folder, torch_dtype, batch)
        gc.collect()
    peak = max(peak, matmul_flops_per_second(torch_dtype))

    hf_best = max((v for k, v in results.items() if k.startswith("HF")), default=float("nan"))
    print(f"{NUM_REQUESTS} requests x {OUTPUT_TOKENS} output tokens, prompt {prompt_len} tokens, {args.dtype}")
    for name, tokens_per_s in results.items():
        print(f"  {name:<22} {tokens_per_s:7.1f} output tokens/s   {tokens_per_s / hf_best:5.2f}x HF best")
    print(f"workload {flops / 1e12:.2f} TFLOP; matmul peak {peak / 1e9:.0f} GFLOP/s")
    print(f"Tessera roofline fraction: {flops / (total_tokens / results['Tessera']) / peak:.2f}  (goal >= 0.6)")
    print(f"Tessera vs HF best: {results['Tessera'] / hf_best:.2f}x  (goal >= 2)")


if __name__ == "__main__":
    main()
