"""Serving benchmark: concurrent streaming chat clients with images against `tessera serve`.

Starts the server in-process on a free loopback port with the bundled demo model, then runs the
same requests (each a distinct synthetic scene + question, fixed answer length) twice:
  * baseline: one client at a time (no batching across HTTP requests),
  * N concurrent clients (continuous batching across HTTP requests),
and prints requests/s, output tokens/s and TTFT p50/p99 of each, with the ratio. Every request
must complete with the expected number of tokens, and all KV blocks must be free afterwards.
Bounded: --requests requests, --concurrency clients, --deadline seconds per phase; loopback only.

python -m benchmarks.bench_serve [--requests 48] [--concurrency 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import re
import statistics
import sys
import time

import httpx
import torch

from tessera import TINY_DEMO_MODEL
from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.entrypoints.openai.api_server import ServerThread, build_app
from tools import tiny_demo_data


def make_requests(n: int, seed: int, max_tokens: int) -> list[dict]:
    rng = random.Random(seed)
    bodies = []
    for _ in range(n):
        image, question, _, _ = tiny_demo_data.make_example(rng, size=256)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
        bodies.append({
            "model": "demo", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
        })  # fmt: skip
    return bodies


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float, int]:
    """(time to first token, total time, output tokens) of one streamed request."""
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if ttft is None:
        raise RuntimeError("a request produced no text")
    return ttft, time.perf_counter() - start, tokens


async def phase(url: str, bodies: list[dict], concurrency: int, deadline: float) -> dict:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=deadline, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def bounded(body: dict) -> tuple[float, float, int]:
            async with limit:
                return await one_request(client, url, body)

        start = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(bounded(b) for b in bodies)), timeout=deadline)
        wall = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    return {
        "wall": wall,
        "rps": len(bodies) / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "completed": sum(r[2] == bodies[0]["max_tokens"] for r in results),
    }


def blocks_in_use(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    names = ("tessera_kv_blocks_used", "tessera_requests_running", "tessera_requests_waiting")
    return {n: float(re.search(rf"^{n} (\S+)$", text, re.MULTILINE).group(1)) for n in names}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds allowed per phase")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    engine = AsyncEngine(LLMEngine.from_options(str(TINY_DEMO_MODEL), kv_cache_memory="256MiB", max_num_seqs=64))
    app = build_app(engine, model_name="demo")
    bodies = make_requests(args.requests, seed=99, max_tokens=args.max_tokens)
    ok = True
    with ServerThread(app) as url:
        asyncio.run(phase(url, bodies[:2], 1, args.deadline))  # warm-up
        print(f"{args.requests} streaming chat requests, one 256x256 image each, {args.max_tokens} output tokens, "
              f"demo model, {args.threads} threads")  # fmt: skip
        rows = []
        for label, concurrency in (("1 client at a time", 1), (f"{args.concurrency} concurrent", args.concurrency)):
            # distinct images per phase: the prefix and encoder caches must not carry over
            shuffled = make_requests(args.requests, seed=1000 + concurrency, max_tokens=args.max_tokens)
            result = asyncio.run(phase(url, shuffled, concurrency, args.deadline))
            deadline = time.monotonic() + 10
            while any(blocks_in_use(url).values()) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = blocks_in_use(url)
            complete = result["completed"] == args.requests
            ok &= complete and not any(left.values())
            rows.append((label, result))
            print(f"{label:>20}: {result['rps']:6.2f} req/s  {result['rps'] * args.max_tokens:7.1f} tok/s  "
                  f"TTFT p50 {result['ttft_p50'] * 1000:7.1f} ms  p99 {result['ttft_p99'] * 1000:7.1f} ms  "
                  f"completed {result['completed']}/{args.requests}  after: {left}")  # fmt: skip
        base, conc = rows[0][1], rows[1][1]
        print(f"concurrent / one at a time: {conc['rps'] / base['rps']:.2f}x requests/s")
    engine.shutdown()
    print("all requests completed and all KV blocks free" if ok else "FAILED: incomplete requests or blocks left")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
