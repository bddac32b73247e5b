"""`tessera bench serve` against the demo server on loopback: a small load, its report and its JSON result."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from tessera.entrypoints.cli import main
from testkit.server import API_KEY


def _bench(url: str, *extra: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = main(["bench", "serve", "--base-url", url, "--api-key", API_KEY, "--disable-tqdm", *extra], stdout=out)
    return rc, out.getvalue()


def _value(report: str, label: str) -> float:
    line = next(line for line in report.splitlines() if line.startswith(label))
    return float(line[len(label) :])


def test_bench_serve_random_mm_at_a_concurrency(server, tmp_path):
    result_file = tmp_path / "result.json"
    rc, report = _bench(server[0], "--dataset", "random-mm", "--num-prompts", "6", "--max-concurrency", "3",
                        "--max-tokens", "4", "--ignore-eos", "--image-size", "64x64", "--image-size", "96x48",
                        "--result-file", str(result_file))  # fmt: skip
    print(report)
    assert rc == 0
    assert "Serving Benchmark Result" in report
    assert _value(report, "Successful requests:") == 6
    assert _value(report, "Maximum request concurrency:") == 3
    assert _value(report, "Total generated tokens:") == 6 * 4  # ignore_eos: each answer is max_tokens long
    assert _value(report, "Total input tokens:") > 6 * 10  # each prompt holds an image
    for label in ("Request throughput (req/s):", "Output token throughput (tok/s):", "Mean TTFT (ms):",
                  "Median TPOT (ms):", "P99 ITL (ms):", "Mean E2EL (ms):"):  # fmt: skip
        assert _value(report, label) > 0, label

    result = json.loads(result_file.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["model_id"] == "demo" and result["max_concurrency"] == 3 and result["request_rate"] == "inf"
    assert result["output_lens"] == [4] * 6 and result["total_output_tokens"] == 24
    # one gap per streamed chunk after the first: 3 when every token's text is sent as it comes, fewer when a
    # token's text is held back (an incomplete UTF-8 sequence) and goes with the next
    assert all(len(itl) <= 3 for itl in result["itls"]) and sum(map(len, result["itls"])) > 0
    assert all(0 < ttft <= e2el for ttft, e2el in zip(result["ttfts"], result["e2els"]))
    assert result["p99_ttft_ms"] >= result["median_ttft_ms"] > 0
    assert result["output_throughput"] == pytest.approx(24 / result["duration"])


def test_bench_serve_jsonl_at_a_request_rate(server, tmp_path):
    Image.new("RGB", (40, 30), "red").save(tmp_path / "red.png")
    lines = [{"prompt": "What colour is this?", "image": "red.png", "max_tokens": 3}, {"prompt": "Say hi."}]
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result_file = tmp_path / "result.json"
    rc, report = _bench(server[0], "--dataset-path", str(dataset), "--num-prompts", "4", "--request-rate", "50",
                        "--max-tokens", "2", "--ignore-eos", "--model", "demo",
                        "--result-file", str(result_file))  # fmt: skip
    assert rc == 0, report
    result = json.loads(result_file.read_text())
    assert result["completed"] == 4 and result["dataset"] == "jsonl" and result["request_rate"] == 50
    assert result["output_lens"] == [3, 2, 3, 2]  # the line's max_tokens, else --max-tokens
    assert result["input_lens"][0] > result["input_lens"][1]  # the image's tokens


def test_bench_serve_reports_failures(server, tmp_path):
    out = io.StringIO()
    rc = main(["bench", "serve", "--base-url", server[0], "--api-key", "wrong", "--model", "demo", "--disable-tqdm",
               "--num-prompts", "2", "--max-tokens", "2", "--image-size", "32x32"], stdout=out)  # fmt: skip
    assert rc == 2
    assert "Failed requests:                        2" in out.getvalue()


@pytest.mark.parametrize("bad", [["--num-prompts", "0"], ["--request-rate", "0"], ["--image-size", "12"],
                                 ["--dataset", "jsonl"]])  # fmt: skip
def test_bench_serve_refuses_bad_arguments(bad, capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", *bad]) == 1
    assert "tessera: error:" in capsys.readouterr().err
