"""/metrics in vLLM's names and meanings (`vllm:*`), beside Tessera's own: after a few requests the counters grew
by the requests' token counts, the histograms counted each request (ITL each gap), the buckets are vLLM's and
cumulative."""

from __future__ import annotations

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tessera.entrypoints.openai.metrics import VLLM_ITL_BUCKETS, VLLM_REQUEST_LATENCY_BUCKETS, VLLM_TTFT_BUCKETS
from testkit.server import wait_until_idle

PROMPT = "Describe, in a few plain words, what a tessera is and where one would find it in a mosaic floor. " * 2


def _scrape(url: str) -> dict[str, dict]:
    """name -> {"type", "samples": {(sample name, sorted labels without model_name): value}, "models"}."""
    families = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        samples, models = {}, set()
        for s in family.samples:
            models.add(s.labels.get("model_name"))
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
        families[family.name] = {"type": family.type, "samples": samples, "models": models}
    return families


def _value(scrape: dict, family: str, sample: str, **labels: str) -> float:
    return scrape[family]["samples"].get((sample, tuple(sorted(labels.items()))), 0.0)


def _buckets(scrape: dict, family: str) -> list[tuple[float, float]]:
    samples = scrape[family]["samples"]
    return sorted((float(dict(labels)["le"]), value) for (name, labels), value in samples.items()
                  if name == family + "_bucket")  # fmt: skip


def test_vllm_series_after_requests(server, client):
    url = server[0]
    wait_until_idle(url)
    before = _scrape(url)
    usages = []
    for _ in range(3):  # the same prompt: the second and third find its blocks in the prefix cache
        reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=3, extra_body={"ignore_eos": True})  # fmt: skip
        usages.append(reply.usage)
    stream = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})  # fmt: skip
    usages += [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usages) == 4
    wait_until_idle(url)
    after = _scrape(url)

    def delta(family: str, sample: str, **labels: str) -> float:
        return _value(after, family, sample, **labels) - _value(before, family, sample, **labels)

    prompt_tokens = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert generated == 3 * 3 + 4
    assert delta("vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens", "vllm:generation_tokens_total") == generated
    assert delta("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 4
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):  # fmt: skip
        assert delta(name, name + "_count") == 4, name
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert delta(name, name + "_count") == generated - 4, name  # a gap between each two tokens
        assert 0 < delta(name, name + "_sum") < 60, name
    assert delta("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert delta("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == generated
    assert (
        0
        < delta("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum")
        <= delta("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum")
    )

    queries = delta("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
    hits = delta("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    assert queries >= prompt_tokens and 0 < hits <= queries  # tokens, as vLLM counts them
    assert delta("vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_hits_total") == hits

    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert after[name]["type"] == "gauge" and _value(after, name, name) == 0
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert after[name]["type"] == "gauge" and _value(after, name, name) == 0  # idle: no block in use

    for family, bounds in (("vllm:time_to_first_token_seconds", VLLM_TTFT_BUCKETS),
                           ("vllm:inter_token_latency_seconds", VLLM_ITL_BUCKETS),
                           ("vllm:time_per_output_token_seconds", VLLM_ITL_BUCKETS),
                           ("vllm:e2e_request_latency_seconds", VLLM_REQUEST_LATENCY_BUCKETS),
                           ("vllm:request_prompt_tokens", None)):  # fmt: skip
        assert after[family]["type"] == "histogram"
        buckets = _buckets(after, family)
        if bounds is not None:
            assert [le for le, _ in buckets] == [*bounds, math.inf]
        counts = [count for _, count in buckets]
        assert counts == sorted(counts), family  # cumulative
        assert counts[-1] == _value(after, family, family + "_count")
    assert [le for le, _ in _buckets(after, "vllm:request_prompt_tokens")][:6] == [1, 2, 5, 10, 20, 50]

    for name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success", "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_hits"):  # fmt: skip
        assert after[name]["type"] == "counter"
    vllm_families = [family for name, family in after.items() if name.startswith("vllm:")]
    models = set().union(*(family["models"] for family in vllm_families))
    assert len(models) == 1 and None not in models and "" not in models  # every vllm: sample has its model_name

    # Tessera's own series are still there
    assert (
        _value(after, "tessera_generation_tokens", "tessera_generation_tokens_total")
        - _value(before, "tessera_generation_tokens", "tessera_generation_tokens_total")
        == generated
    )
    assert "tessera_kv_blocks_total" in after
