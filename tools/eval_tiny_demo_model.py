"""Evaluate the bundled demo model on held-out synthetic VQA questions, through Tessera.

Generates ``-n`` questions (default 500) with ``tools/tiny_demo_data.py`` from a seed the training never uses,
answers them with ``tessera.LLM(model).generate`` (one batched call, greedy, prompt
``USER: <image>\\n{question} ASSISTANT:`` rendered by the model's chat template), and prints exact-match
accuracy (after stripping and lower-casing) per question kind and overall. A sample of the questions is
also answered with Hugging Face transformers' greedy ``generate`` and compared with Tessera's answers.

Exit status 0 when the goals are met (overall >= 95%, every kind >= 90%, HF agrees on every sampled
answer), 1 otherwise.

Usage: python -m tools.eval_tiny_demo_model [MODEL_FOLDER] [-n 500] [--seed 12345] [--hf-sample 20]
       [--dtype float32|bfloat16] [--quantization int8|int4]

HF runs the float32 model: with another dtype or quantization its sample measures how far the answers moved.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from tessera import LLM, SamplingParams
from tools import tiny_demo_data

REPO = Path(__file__).resolve().parents[1]

GOAL_OVERALL, GOAL_PER_KIND = 0.95, 0.90


def normalise(text: str) -> str:
    return text.strip().lower()


def main() -> int:
    p = argparse.ArgumentParser(description="Evaluate the demo model through Tessera (and spot-check against HF).")
    p.add_argument("model", nargs="?", default=str(REPO / "tessera" / "tiny_demo_model"))
    p.add_argument("-n", type=int, default=500, help="held-out questions")
    p.add_argument("--seed", type=int, default=12345, help="data seed (training uses seeds 0-2)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--hf-sample", type=int, default=20, help="questions also answered by HF transformers")
    p.add_argument("--show-errors", type=int, default=10, help="wrong answers to print")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--image-size", type=int, default=tiny_demo_data.IMAGE_SIZE,
                   help="render the scenes at this size (the processor resizes them to the model's input)")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default=None, help="weight quantization of the language model (int8, int4)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.time()
    data = tiny_demo_data.make_dataset(args.n, args.seed, args.image_size)
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_memory="256MiB")
    hf_processor = llm.engine.processor.info.get_hf_processor()

    prompts = []
    for image, question, _, _ in data:
        message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        prompt = hf_processor.apply_chat_template(message, add_generation_prompt=True)
        assert prompt == f"USER: <image>\n{question} ASSISTANT:", repr(prompt)
        prompts.append({"prompt": prompt, "multi_modal_data": {"image": image}})
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t1 = time.time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    t_gen = time.time() - t1
    answers = [o.outputs[0].text for o in outputs]

    scores: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    errors = []
    for (_, question, expected, kind), answer in zip(data, answers):
        ok = normalise(answer) == normalise(expected)
        scores[kind][0] += ok
        scores[kind][1] += 1
        if not ok:
            errors.append((kind, question, expected, answer))
    right = sum(r for r, _ in scores.values())

    print(f"model: {args.model} ({args.dtype}, quantization {args.quantization})")
    print(f"{args.n} held-out questions (seed {args.seed}, {args.image_size}px), Tessera greedy, {t_gen:.1f}s in all")
    print(f"{'kind':<10} {'correct':>8} {'total':>6} {'accuracy':>9}")
    for kind in tiny_demo_data.KINDS:
        r, t = scores[kind]
        print(f"{kind:<10} {r:>8} {t:>6} {r / max(t, 1):>9.1%}")
    print(f"{'overall':<10} {right:>8} {args.n:>6} {right / args.n:>9.1%}")
    for kind, question, expected, answer in errors[: args.show_errors]:
        print(f"  wrong [{kind}] {question!r}: expected {expected!r}, got {answer!r}")

    agree, sample = 0, min(args.hf_sample, args.n)
    if sample:
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        processor = AutoProcessor.from_pretrained(args.model)
        model = LlavaForConditionalGeneration.from_pretrained(args.model, torch_dtype=torch.float32).eval()
        picks = sorted(random.Random(args.seed).sample(range(args.n), sample))
        for i in picks:
            inputs = processor(images=data[i][0], text=prompts[i]["prompt"], return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=args.max_tokens, do_sample=False)
            hf_ids = out[0, inputs["input_ids"].shape[1] :].tolist()
            hf_answer = processor.tokenizer.decode(hf_ids, skip_special_tokens=True)
            eos = {processor.tokenizer.eos_token_id, processor.tokenizer.pad_token_id}
            same_ids = [t for t in hf_ids if t not in eos] == [
                t for t in outputs[i].outputs[0].token_ids if t not in eos
            ]
            if same_ids and hf_answer == answers[i]:
                agree += 1
            else:
                print(f"  HF disagrees on {data[i][1]!r}: HF {hf_answer!r}, Tessera {answers[i]!r}")
        print(f"HF transformers greedy generate agrees with Tessera on {agree}/{sample} sampled questions")
    print(f"total time {time.time() - t0:.1f}s")

    failed = []
    if right / args.n < GOAL_OVERALL:
        failed.append(f"overall {right / args.n:.1%} < {GOAL_OVERALL:.0%}")
    failed += [f"{kind} {r / t:.1%} < {GOAL_PER_KIND:.0%}" for kind, (r, t) in scores.items() if r / t < GOAL_PER_KIND]
    if agree != sample:
        failed.append(f"HF agrees on {agree}/{sample} only")
    print("GOALS MET" if not failed else "GOALS NOT MET: " + "; ".join(failed))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
