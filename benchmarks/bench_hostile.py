"""Hostile inputs against `tessera serve` (issue 13's list): what each gets, and what it costs the
others. For each input, a well-formed chat request is sent alongside; the table shows the hostile
request's status and time, the well-formed request's latency as a ratio to its latency alone, and
how much the server's RSS grew.

python -m benchmarks.bench_hostile [--rounds 3]
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import http.server
import statistics
import threading
import time
from pathlib import Path

import httpx

from tessera import TINY_DEMO_MODEL
from tessera.engine.async_engine import AsyncEngine
from tessera.engine.llm_engine import LLMEngine
from tessera.entrypoints.openai.api_server import ServerThread, build_app
from tessera.multimodal.media import MediaPolicy
from testkit import png_bytes
from testkit.server import rss_bytes

REPO = Path(__file__).resolve().parents[1]
IMAGE = "data:image/png;base64," + base64.b64encode((REPO / "examples" / "three_shapes.png").read_bytes()).decode()


def chat_body(url: str = IMAGE, text: str = "Describe the image.", **extra) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 16, "temperature": 0, **extra}


def png(width: int, height: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(width, height)).decode()


class Trickle(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.end_headers()
        try:
            for _ in range(1200):
                self.wfile.write(b"\x89")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass

    def log_message(self, *args):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trickle = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    trickle.daemon_threads = True
    threading.Thread(target=trickle.serve_forever, daemon=True).start()
    slow_url = f"http://127.0.0.1:{trickle.server_address[1]}/slow.png"

    engine = AsyncEngine(LLMEngine.from_options(str(TINY_DEMO_MODEL), kv_cache_memory="64MiB"))
    policy = MediaPolicy(fetch_urls=True, allow_private_networks=True)  # so the local trickle server is reached
    huge_text = "circle " * 4_300_000  # 30 MB, under the default 32 MiB body cap
    inputs = {
        "completions prompt [1, 99999]": ("/v1/completions", {"prompt": [1, 99999], "max_tokens": 4}),
        "completions prompt [1, -5]": ("/v1/completions", {"prompt": [1, -5], "max_tokens": 4}),
        "1x60000 PNG": ("/v1/chat/completions", chat_body(png(1, 60000))),
        "13000x13000 PNG": ("/v1/chat/completions", chat_body(png(13000, 13000))),
        "20000x20000 bomb, /tokenize": ("/tokenize", {"messages": chat_body(png(20000, 20000))["messages"]}),
        "30 MB text prompt": ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge_text}]}),
        "content as an object": ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"a": 1}}]}),
        "5 trickling URLs (10 s deadline)": ("/v1/chat/completions", chat_body(slow_url)),
        "echo: true": ("/v1/completions", {"prompt": "hi", "echo": True}),
    }
    with ServerThread(build_app(engine, model_name="demo", media_policy=policy)) as base:
        client = httpx.Client(base_url=base, timeout=120)

        def good() -> float:
            start = time.perf_counter()
            assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
            return time.perf_counter() - start

        alone = statistics.median(good() for _ in range(max(3, args.rounds)))
        print(f"well-formed request alone: {alone * 1000:.0f} ms (median)")
        print(f"{'input':36} {'status':>8} {'time s':>7} {'others x':>9} {'RSS MB':>7}")
        for name, (path, body) in inputs.items():
            copies = 5 if name.startswith("5 ") else 1
            rows = []
            for _ in range(args.rounds):
                before = rss_bytes()
                with concurrent.futures.ThreadPoolExecutor(copies + 1) as pool:
                    start = time.perf_counter()
                    hostile = [pool.submit(client.post, path, json=body) for _ in range(copies)]
                    other = pool.submit(good)
                    statuses = sorted({f.result().status_code for f in hostile})
                    rows.append((statuses, time.perf_counter() - start, other.result() / alone, rss_bytes() - before))
            status = "/".join(map(str, rows[0][0]))
            took, ratio, grew = (statistics.median(r[i] for r in rows) for i in (1, 2, 3))
            print(f"{name:36} {status:>8} {took:7.2f} {ratio:9.2f} {grew / 2**20:7.0f}")
            assert client.get("/health").status_code == 200
    engine.shutdown()
    trickle.shutdown()


if __name__ == "__main__":
    main()
