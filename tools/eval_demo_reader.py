"""Evaluate the demo VLM's reader alone: SmolLM2 with a LoRA answering the held-out questions of
``make_eval_scenes`` from each scene's *true* slot tokens (no image, no encoder), greedy, exact match per kind.

It is the reader's ceiling and the quick check of a reader phase: a few hundred questions a minute on 2 CPU
cores (batched), where ``tools.eval_demo_model`` runs the whole model through Tessera. Use scene seeds other
than the end-to-end eval's (4242, 777, 31337) to pick between readers.

Usage: python -m tools.eval_demo_reader LORA [--seeds 5001,5002] [-n 100] [--kinds compound,relation] [--aligned]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tools import demo_vlm_datasets as datasets
from tools.demo_vlm_lora import add_lora, load_lora_state
from tools.demo_vlm_reader import score_reader
from tools.train_demo_vlm import load_language_model


def load_reader(lora_file: Path, work: Path):
    """SmolLM2 in float32 with the LoRA in `lora_file` (its rank read from the file) -> (model, tokenizer)."""
    model, tokenizer = load_language_model(work, seed=0, device="cpu")
    model = model.float()
    state = load_file(lora_file)
    rank = next(value.shape[0] for name, value in state.items() if name.endswith("lora_A"))
    load_lora_state(add_lora(model.model.language_model, rank, alpha=2.0 * rank), state)
    return model, tokenizer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("lora", type=Path)
    p.add_argument("--seeds", default="5001,5002", help="eval scene seeds, comma-separated")
    p.add_argument("-n", type=int, default=100, help="questions per kind and seed")
    p.add_argument("--kinds", default=None, help="comma-separated kinds (default: all)")
    p.add_argument("--aligned", action="store_true", help="scenes with two objects in one column or row")
    p.add_argument("--work", type=Path, default=Path("/tmp/tessera-demo-reader-eval"))
    p.add_argument("--show-errors", type=int, default=20)
    args = p.parse_args()
    kinds = args.kinds.split(",") if args.kinds else list(datasets.KINDS)
    if unknown := [kind for kind in kinds if kind not in datasets.KINDS]:
        p.error(f"unknown kind(s) {', '.join(unknown)}; kinds: {', '.join(datasets.KINDS)}")
    torch.manual_seed(0)
    model, tokenizer = load_reader(args.lora, args.work)
    items = [item for seed in (int(s) for s in args.seeds.split(","))
             for item in datasets.make_eval_scenes(args.n, seed, aligned=args.aligned) if item[1] in kinds]  # fmt: skip
    start = time.perf_counter()
    scores, misses = score_reader(model, tokenizer, items)
    for kind, (hit, n) in sorted(scores.items()):
        print(f"{kind:<12}{hit:>5} / {n:<5}{100 * hit / n:6.1f}%")
    hits, total = sum(h for h, _ in scores.values()), sum(n for _, n in scores.values())
    print(f"all {hits} / {total} from the true slots in {time.perf_counter() - start:.0f} s")
    for kind, question, answer, text in misses[: args.show_errors]:
        print(f"  wrong [{kind}] {question!r}: expected {answer!r}, got {text!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
