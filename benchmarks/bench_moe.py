"""Batch-1 decode of a mixture-of-experts model against a dense model with the same active parameters, and
against the same MoE computed the naive way (every expert for every token), in one process.

MoE: Qwen3-MoE's shape at 4 layers, hidden 768, 12 heads over 4 KV heads of 64 dims, 32 routed experts of
width 768, top-2 (so 2 x 768 = 1536 active MLP width: 14 MB of expert weights read per layer and token out of
226 MB held, fp32). Dense: the same model with a 1536-wide MLP (Qwen3). If decode streams only the routed
experts, the MoE's tokens/s come close to the dense model's; a layer that reads every expert would be ~16x
slower in its MLPs. The dense model's decode layers run as one native call each (models/native_decode.py), the
MoE's as eager modules, so the dense model is also timed with its layers eager. Random weights, HF's seeded
initialisation. The int8 rows quantize both models weight-only (the experts as the other linears).

    .venv/bin/python -m benchmarks.bench_moe [--repeats 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from tessera import LLM, SamplingParams
from tessera.layers.fused_moe import FusedMoE

SHAPE = dict(hidden_size=768, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
MOE = dict(num_experts=32, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True)
FOLDERS = {"moe": Path("/tmp/tessera-bench-qwen3moe-4l"), "dense": Path("/tmp/tessera-bench-qwen3dense-4l")}
PROMPT = "The experts of a mixture take turns, and each token asks only a few of them to speak"


def build(kind: str) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from testkit import build_tokenizer

    folder = FOLDERS[kind]
    if (folder / "config.json").is_file():
        return folder
    tokenizer = build_tokenizer("qwen")
    common = dict(SHAPE, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if kind == "moe":
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, **MOE))
        else:
            model = Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=MOE["num_experts_per_tok"] * 768))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def every_expert(moe: FusedMoE) -> None:
    """The naive layer: all experts run for every token, the unrouted ones with weight 0 (the baseline)."""

    def forward(hidden_states: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        dense = torch.zeros(hidden_states.shape[0], moe.num_experts, dtype=hidden_states.dtype)
        dense.scatter_(1, expert_ids, weights.to(hidden_states.dtype))
        out = torch.zeros_like(hidden_states)
        for expert in range(moe.num_experts):
            out += moe.expert_mlp(expert, hidden_states) * dense[:, expert : expert + 1]
        return out

    moe.forward = forward


def decode_rate(llm: LLM, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    return 1 / out.outputs[0].metrics.time_per_output_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    engines = {kind: LLM(str(build(kind)), kv_cache_memory="64MiB", enable_prefix_caching=False)
               for kind in ("moe", "dense")}  # fmt: skip
    naive = LLM(str(FOLDERS["moe"]), kv_cache_memory="64MiB", enable_prefix_caching=False)
    for module in naive.engine.core.model.modules():
        if isinstance(module, FusedMoE):
            every_expert(module)
    engines["moe, every expert"] = naive
    eager = LLM(str(FOLDERS["dense"]), kv_cache_memory="64MiB", enable_prefix_caching=False)
    for layer in eager.engine.core.model.model.layers:
        layer._native = False  # the eager modules, as the MoE layers run today (no fused native decode layer)
    engines["dense, eager layers"] = eager
    for kind in ("moe", "dense"):  # weight-only int8: the experts quantize as the other linears (half the bytes)
        engines[f"{kind}, int8"] = LLM(str(FOLDERS[kind]), kv_cache_memory="64MiB", enable_prefix_caching=False,
                                       quantization="int8")  # fmt: skip
    rates: dict[str, list[float]] = {kind: [] for kind in engines}
    for _ in range(args.repeats):
        for kind, llm in engines.items():
            rates[kind].append(decode_rate(llm, args.tokens))
    medians = {kind: statistics.median(values) for kind, values in rates.items()}
    for kind, values in rates.items():
        print(f"{kind:>20}: {medians[kind]:7.1f} tok/s  (runs: {', '.join(f'{v:.1f}' for v in values)})")
    print(f"MoE / dense with the same active parameters: x{medians['moe'] / medians['dense']:.2f}")
    print(f"MoE routed / every expert: x{medians['moe'] / medians['moe, every expert']:.2f}")
    print(f"MoE / dense run by the same eager modules: x{medians['moe'] / medians['dense, eager layers']:.2f}")
    print(
        f"int8: MoE / dense x{medians['moe, int8'] / medians['dense, int8']:.2f}; "
        f"MoE int8 / fp32 x{medians['moe, int8'] / medians['moe']:.2f}"
    )


if __name__ == "__main__":
    main()
