"""`tessera bench serve`: load any OpenAI-compatible server (Tessera, vLLM, llama-server) with image+text chat
requests and report throughput and latency as `vllm bench serve` does.

tessera bench serve --base-url http://127.0.0.1:8000 --dataset random-mm --num-prompts 100 --request-rate 4
tessera bench serve --dataset-path prompts.jsonl --max-concurrency 8 --result-file result.json

A pure HTTP client: streaming chat completions over httpx; per request it measures the time to the first
token (TTFT), the gaps between streamed tokens (ITL), the time per output token after the first (TPOT) and
the end-to-end latency. Token counts come from the server's usage (`stream_options.include_usage`), else a
streamed chunk counts as one token. Imports only the standard library, httpx, numpy, PIL and tqdm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from .bench_datasets import BenchPrompt, jsonl_prompts, random_mm_prompts


@dataclass
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server, without /v1 (default http://127.0.0.1:8000)")  # fmt: skip
    parser.add_argument("--endpoint", default="/v1/chat/completions", help="(default /v1/chat/completions)")
    parser.add_argument("--model", default=None, help="the model id to send (default: the first of GET /v1/models)")
    parser.add_argument("--api-key", default=None, help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--dataset", "--dataset-name", dest="dataset", choices=("random-mm", "jsonl"), default=None,
                        help="random-mm: random images with short questions, made here; jsonl: --dataset-path "
                        "(default: jsonl when --dataset-path is given, else random-mm)")  # fmt: skip
    parser.add_argument("--dataset-path", default=None, metavar="FILE",
                        help='JSONL, one {"prompt", "image" (a path or URL, optional), "max_tokens" (optional)} '
                        "a line")  # fmt: skip
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    parser.add_argument("--image-size", action="append", default=None, metavar="WxH",
                        help="random-mm image sizes, cycled (repeatable; default 448x448)")  # fmt: skip
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals; inf sends all at once (default inf)")  # fmt: skip
    parser.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="output tokens per request, unless the dataset line says (default 64)")  # fmt: skip
    parser.add_argument("--ignore-eos", action="store_true",
                        help="send ignore_eos (vLLM's and Tessera's extension) so each answer is max_tokens "
                        "long")  # fmt: skip
    parser.add_argument("--temperature", type=float, default=0.0, help="(default 0)")
    parser.add_argument("--seed", type=int, default=0, help="for the random images, questions and arrivals")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (default 99)")
    parser.add_argument("--result-file", default=None, metavar="FILE", help="write the result as JSON here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for one request (default 600)")


# ---- datasets --------------------------------------------------------------------------------------


def _image_size(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or int(width) < 1 or int(height) < 1:
        raise ValueError(f"--image-size takes WxH, e.g. 448x448, got {text!r}")
    return int(width), int(height)


# ---- requests --------------------------------------------------------------------------------------


def _payload(prompt: BenchPrompt, model: str, args: argparse.Namespace) -> dict:
    content: list[dict] = []
    if prompt.image_url is not None:
        content.append({"type": "image_url", "image_url": {"url": prompt.image_url}})
    content.append({"type": "text", "text": prompt.text})
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": prompt.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _send(client: Any, url: str, body: dict, headers: dict) -> RequestResult:
    result = RequestResult()
    chunks, finished = 0, False
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = json.dumps(event["error"])[:300]
                    return result
                if event.get("usage"):
                    result.prompt_tokens = event["usage"].get("prompt_tokens") or 0
                    result.output_tokens = event["usage"].get("completion_tokens") or 0
                choices = event.get("choices") or ()
                if any(_delta_text(choice) for choice in choices):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
                elif chunks == 0 and any(choice.get("finish_reason") for choice in choices):
                    result.ttft = time.perf_counter() - start  # an answer of no text: its tokens came here
                finished = finished or any(choice.get("finish_reason") for choice in choices)
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.success = finished
        if not finished:
            result.error = "the stream ended without a finish_reason"
    except Exception as e:  # a refused connection, a timeout, a broken stream: one failed request
        result.error = f"{type(e).__name__}: {e}"
    return result


def _delta_text(choice: dict) -> str:
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or choice.get("text") or ""


async def _arrivals(num: int, rate: float, seed: int):
    """Yield 0..num-1, spaced by exponential gaps of mean 1/rate (none when rate is inf)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for i in range(num):
        yield i
        if math.isfinite(rate) and rate > 0 and i < num - 1:
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))


async def _run(prompts: list[BenchPrompt], model: str, args: argparse.Namespace, headers: dict):
    import httpx
    from tqdm import tqdm

    url = args.base_url.rstrip("/") + args.endpoint
    limit = args.max_concurrency or len(prompts)
    semaphore = asyncio.Semaphore(limit)
    bar = tqdm(total=len(prompts), disable=args.disable_tqdm, file=sys.stderr)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=limit)) as client:

        async def one(prompt: BenchPrompt) -> RequestResult:
            async with semaphore:
                result = await _send(client, url, _payload(prompt, model, args), headers)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(prompts[i])) async for i in _arrivals(len(prompts), args.request_rate,
                                                                               args.seed)]  # fmt: skip
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def _default_model(base_url: str, headers: dict) -> str:
    import httpx

    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


# ---- report ----------------------------------------------------------------------------------------


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict[str, Any]:
    """vLLM bench serve's result fields: counts, throughputs, and mean / median / std / pN in ms of TTFT,
    TPOT (excluding the first token), ITL and E2E latency."""
    import numpy as np

    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
    }
    for name, values in series.items():
        ms = np.asarray(values, dtype=float) * 1000 if values else np.zeros(1)
        summary[f"mean_{name}_ms"] = float(ms.mean())
        summary[f"median_{name}_ms"] = float(np.median(ms))
        summary[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            summary[f"p{_pct(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return summary


def _pct(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def format_report(summary: dict[str, Any], args: argparse.Namespace, percentiles: list[float]) -> str:
    width = 50

    def row(label: str, value: Any, digits: int = 2) -> str:
        text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
        return f"{label:<40}{text:<10}"

    def section(title: str) -> str:
        return f"{title:-^{width}}"

    lines = [f"{' Serving Benchmark Result ':=^{width}}"]
    lines.append(row("Successful requests:", summary["completed"]))
    if summary["failed"]:
        lines.append(row("Failed requests:", summary["failed"]))
    if args.max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", args.max_concurrency))
    lines.append(row("Request rate configured (RPS):", float(args.request_rate)))
    lines.append(row("Benchmark duration (s):", summary["duration"]))
    lines.append(row("Total input tokens:", summary["total_input_tokens"]))
    lines.append(row("Total generated tokens:", summary["total_output_tokens"]))
    lines.append(row("Request throughput (req/s):", summary["request_throughput"]))
    lines.append(row("Output token throughput (tok/s):", summary["output_throughput"]))
    lines.append(row("Total Token throughput (tok/s):", summary["total_token_throughput"]))
    titles = {
        "ttft": ("Time to First Token", "TTFT"),
        "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
        "itl": ("Inter-token Latency", "ITL"),
        "e2el": ("End-to-end Latency", "E2EL"),
    }
    for name, (title, short) in titles.items():
        lines.append(section(title))
        lines.append(row(f"Mean {short} (ms):", summary[f"mean_{name}_ms"]))
        lines.append(row(f"Median {short} (ms):", summary[f"median_{name}_ms"]))
        for p in percentiles:
            lines.append(row(f"P{_pct(p)} {short} (ms):", summary[f"p{_pct(p)}_{name}_ms"]))
    lines.append("=" * width)
    return "\n".join(lines)


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run the benchmark the arguments describe; print the report; 0 when every request succeeded."""
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
        if any(not 0 < p <= 100 for p in percentiles):
            raise ValueError("--metric-percentiles are in (0, 100]")
        if args.num_prompts < 1:
            raise ValueError("--num-prompts must be at least 1")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if not args.request_rate > 0:
            raise ValueError("--request-rate must be positive (inf: all at once)")
        dataset = args.dataset or ("jsonl" if args.dataset_path else "random-mm")
        if dataset == "jsonl":
            if not args.dataset_path:
                raise ValueError("--dataset jsonl needs --dataset-path")
            prompts = jsonl_prompts(args.dataset_path, args.num_prompts, args.max_tokens)
        else:
            sizes = [_image_size(s) for s in (args.image_size or ["448x448"])]
            prompts = random_mm_prompts(args.num_prompts, sizes, args.max_tokens, args.seed)
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        model = args.model or _default_model(args.base_url, headers)
        results, duration = asyncio.run(_run(prompts, model, args, headers))
    except (ValueError, OSError) as e:
        print(f"tessera: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # httpx errors reaching /v1/models
        print(f"tessera: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    summary = summarize(results, duration, percentiles)
    print(format_report(summary, args, percentiles), file=out, flush=True)
    errors = [r.error for r in results if not r.success]
    for error in sorted(set(errors))[:5]:
        print(f"failed: {error}", file=sys.stderr)
    if args.result_file:
        record = {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": "openai-chat",
            "base_url": args.base_url,
            "endpoint": args.endpoint,
            "model_id": model,
            "dataset": dataset,
            "num_prompts": args.num_prompts,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "max_concurrency": args.max_concurrency,
            **summary,
            "input_lens": [r.prompt_tokens for r in results],
            "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "e2els": [r.latency for r in results],
            "errors": [r.error for r in results],
        }
        Path(args.result_file).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0 if not errors else 2
