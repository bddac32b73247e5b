"""Evaluate the demo VLM (the vision side trained by tools/train_demo_vlm.py in front of SmolLM2-135M-Instruct,
assembled by tessera.models.demo_vlm) on held-out questions, through Tessera.

The questions come from ``tools/demo_vlm_datasets.make_eval_scenes``: scenes of held-out layouts and pictures with no
shapes of held-out seeds, phrasings the training never saw, every kind balanced (yes / no / which for relations,
every count and side, yes / no for existence), single-object scenes included. Each is asked as a one-turn chat with
the image (greedy), and the answer must match exactly (after stripping, lower-casing and dropping a final full
stop). A sample is also answered by Hugging Face transformers' greedy ``generate`` on the same folder and compared
token for token. Text-only, the ten ``tools/demo_vlm_chat_data.HELD_OUT_QUESTIONS`` and the ``KNOWLEDGE_QUESTIONS``
(never in training) are answered by the demo model and by SmolLM2-135M-Instruct alone (its GGUF): how many answers
stayed exactly SmolLM2's, and how many knowledge questions each gets right (the LoRA must not make that worse).

``--blame`` says for each miss which stage caused it (``tools.demo_vlm_blame``): the reader, when it answers
wrongly from the scene's true slot tokens too, or the encoder, when its slots differ from the true ones.

Exit status 0 when every kind reaches ``GOAL_PER_KIND`` (pictures with no shapes: ``GOAL_NO_SHAPES``), HF agrees on
every sampled answer and the demo model gets at least as many knowledge questions right as SmolLM2, 1 otherwise.
``--markdown`` prints the table as the README shows it.

Usage: python -m tools.eval_demo_model [MODEL_FOLDER | --vision-dir DIR] [-n 100] [--seed 4242] [--hf-sample 20]
       [--markdown] [--blame] [--aligned]
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from tools import demo_vlm_chat_data as chat_data
from tools import demo_vlm_datasets as datasets
from tools.demo_vlm_reader import normalise

GOAL_PER_KIND = 0.98
GOAL_NO_SHAPES = 0.95


def chat(image, question: str) -> list[dict]:
    content = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": question}]
    return [{"role": "user", "content": content}]


def hf_agreement(model_dir: str, items, outputs, sample: int, seed: int, max_tokens: int) -> int:
    """How many of `sample` random questions HF transformers answers with exactly Tessera's tokens."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    stops = {processor.tokenizer.eos_token_id, processor.tokenizer.pad_token_id}
    agree = 0
    for i in sorted(random.Random(seed).sample(range(len(items)), sample)):
        image, _, question, _ = items[i]
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(images=image, text=prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
        hf_ids = [t for t in out[0, inputs["input_ids"].shape[1] :].tolist() if t not in stops]
        ours = [t for t in outputs[i].outputs[0].token_ids if t not in stops]
        if hf_ids == ours:
            agree += 1
        else:
            print(f"  HF disagrees on {question!r}: HF {processor.tokenizer.decode(hf_ids)!r}, Tessera "
                  f"{outputs[i].outputs[0].text!r}")  # fmt: skip
    return agree


# A number as written in prose: thousands grouped by commas ("7,982,180"), or plain digits, with decimals.
NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")


def knows(answer: str, words: tuple[str, ...]) -> bool:
    """Whether an answer contains one of the words a right answer has (as a whole word, any case); a number
    counts by its value, so "100.0 degrees" knows 100 but "7,982,180 km" does not know 7."""
    text = answer.lower()
    numbers = {float(n.replace(",", "")) for n in NUMBER.findall(text)}
    return any(float(word) in numbers if word.isdigit() else re.search(rf"\b{re.escape(word)}\b", text)
               for word in words)  # fmt: skip


def text_checks(llm, max_tokens: int) -> tuple[int, int, int]:
    """Text-only answers against SmolLM2-135M-Instruct alone (its GGUF): (held-out questions answered exactly
    as SmolLM2 does, knowledge questions SmolLM2 gets right, knowledge questions the demo model gets right);
    prints the differences."""
    from tessera import LLM, SamplingParams
    from tessera.models.demo_vlm import find_smollm2_gguf

    questions = chat_data.HELD_OUT_QUESTIONS + [q for q, _ in chat_data.KNOWLEDGE_QUESTIONS]
    chats = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ours = [o.outputs[0].text for o in llm.chat(chats, params, use_tqdm=False)]
    smollm2 = LLM(str(find_smollm2_gguf()), dtype="float32", kv_cache_memory="64MiB")
    theirs = [o.outputs[0].text for o in smollm2.chat(chats, params, use_tqdm=False)]
    n = len(chat_data.HELD_OUT_QUESTIONS)
    for question, a, b in zip(questions[:n], ours, theirs):
        if a != b:
            print(f"  text answer changed for {question!r}:\n    SmolLM2: {b!r}\n    demo:    {a!r}")
    kept = sum(a == b for a, b in zip(ours[:n], theirs[:n]))
    base_right = demo_right = 0
    for (question, words), a, b in zip(chat_data.KNOWLEDGE_QUESTIONS, ours[n:], theirs[n:]):
        demo_knows, base_knows = knows(a, words), knows(b, words)
        base_right, demo_right = base_right + base_knows, demo_right + demo_knows
        if demo_knows != base_knows:
            print(f"  knowledge {'lost' if base_knows else 'gained'} on {question!r}: SmolLM2 {b!r}, demo {a!r}")
    return kept, base_right, demo_right


def print_blame(llm, model_dir: str, vision_dir: Path, args, scene_items, items, errors) -> None:
    """Per kind, how many misses the reader (wrong from the true slots too) and the encoder (its slots wrong)
    caused (``tools.demo_vlm_blame``), and each miss's cause."""
    from transformers import AutoTokenizer

    from tessera.models.demo_vlm import CHAT_TEMPLATE
    from tools.demo_vlm_blame import CAUSES, blame_misses

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    misses = [(scene_items[i][0], items[i][0], question, expected) for _, question, expected, _, i in errors]
    causes = blame_misses(llm, tokenizer, vision_dir, misses, args.max_tokens)
    tally: dict[str, Counter] = defaultdict(Counter)
    for (kind, question, _, _, _), (cause, true_answer, wrong) in zip(errors, causes):
        tally[kind][cause] += 1
        print(f"  {cause:<10} [{kind}] {question!r}: from the true slots {true_answer!r}; wrong slots {wrong[:4]}")
    print("misses by cause: " + "; ".join(f"{kind} " + ", ".join(f"{c} {tally[kind][c]}" for c in CAUSES
                                                                  if tally[kind][c]) for kind in tally))  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="model folder (default: the demo VLM, assembled)")
    p.add_argument("--vision-dir", type=Path, default=None,
                   help="assemble the demo VLM from this shipped side (what tools/train_demo_vlm.py wrote; "
                        "default: tessera/demo_vlm)")  # fmt: skip
    p.add_argument("-n", type=int, default=100, help="questions per kind")
    p.add_argument("--seed", type=int, default=4242, help="eval set seed (training draws from its own stream)")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--text-tokens", type=int, default=32, help="tokens of each text-only answer compared")
    p.add_argument("--hf-sample", type=int, default=20, help="questions also answered by HF transformers")
    p.add_argument("--show-errors", type=int, default=15)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--aligned", action="store_true",
                   help="two objects of each scene in one column or row, as people draw them (another eval set)")
    p.add_argument("--markdown", action="store_true", help="print the accuracy table in Markdown")
    p.add_argument("--blame", action="store_true",
                   help="say for each miss whether the encoder's slots or the reader caused it (needs the vision "
                        "side: the default model or --vision-dir)")  # fmt: skip
    args = p.parse_args()
    if args.blame and args.model:
        p.error("--blame reads the encoder from the vision side: pass --vision-dir DIR instead of a model folder")

    from tessera import LLM, SamplingParams
    from tessera.models.demo_vlm import SHIPPED_VISION_DIR, demo_model_folder

    model_dir = args.model or str(demo_model_folder(args.vision_dir or SHIPPED_VISION_DIR))
    start = time.time()
    scene_items = datasets.make_eval_scenes(args.n, seed=args.seed, aligned=args.aligned)
    items = datasets.with_images(scene_items)
    llm = LLM(model_dir, dtype=args.dtype, kv_cache_memory="512MiB")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outputs = llm.chat([chat(image, q) for image, _, q, _ in items], params, use_tqdm=False)

    scores: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    errors = []
    for i, ((_, kind, question, expected), output) in enumerate(zip(items, outputs)):
        ok = normalise(output.outputs[0].text) == normalise(expected)
        scores[kind][0] += ok
        scores[kind][1] += 1
        if not ok:
            errors.append((kind, question, expected, output.outputs[0].text, i))

    aligned = ", two objects in one column or row" if args.aligned else ""
    print(f"model: {model_dir} ({args.dtype}); held-out layouts and phrasings{aligned}, seed {args.seed}")
    if args.markdown:
        print("\n| question kind | correct | asked | accuracy |\n|---|---|---|---|")
    for kind in datasets.KINDS:
        right, total = scores[kind]
        cells = (kind, right, total, f"{right / max(total, 1):.1%}")
        print("| {} | {} | {} | {} |".format(*cells) if args.markdown else "{:<10} {:>5} / {:<5} {:>7}".format(*cells))
    for kind, question, expected, answer, _ in errors[: args.show_errors]:
        print(f"  wrong [{kind}] {question!r}: expected {expected!r}, got {answer!r}")
    if args.blame:
        print_blame(llm, model_dir, args.vision_dir or SHIPPED_VISION_DIR, args, scene_items, items, errors)

    goals = {kind: GOAL_NO_SHAPES if kind == "no shapes" else GOAL_PER_KIND for kind in datasets.KINDS}
    failed = [f"{kind} {scores[kind][0] / scores[kind][1]:.1%} (< {goal:.0%})" for kind, goal in goals.items()
              if scores[kind][0] / scores[kind][1] < goal]  # fmt: skip
    sample = min(args.hf_sample, len(items))
    if sample:
        agree = hf_agreement(model_dir, items, outputs, sample, args.seed, args.max_tokens)
        print(f"HF transformers greedy generate agrees with Tessera on {agree}/{sample} sampled questions")
        if agree != sample:
            failed.append(f"HF agrees on {agree}/{sample} only")
    kept, base_right, demo_right = text_checks(llm, args.text_tokens)
    n_text, n_knowledge = len(chat_data.HELD_OUT_QUESTIONS), len(chat_data.KNOWLEDGE_QUESTIONS)
    print(
        f"text-only: {kept}/{n_text} held-out questions get SmolLM2's own answer ({args.text_tokens} tokens); "
        f"knowledge questions right: SmolLM2 {base_right}/{n_knowledge}, demo {demo_right}/{n_knowledge}"
    )
    if demo_right < base_right:
        failed.append(f"text answers got worse ({demo_right} < {base_right} knowledge questions right)")
    print(f"total time {time.time() - start:.0f} s")
    print("GOALS MET" if not failed else "GOALS NOT MET: " + "; ".join(failed))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
