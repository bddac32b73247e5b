"""Prometheus metrics of the server (`GET /metrics`), in a registry of its own per app.

Two families: Tessera's own (`tessera_*`), and vLLM v1's names and meanings (`vllm:*`, each with a
`model_name` label, vLLM's histogram buckets) so that vLLM's Grafana dashboard reads Tessera unchanged.
The request-level `vllm:` series (token counters, latency histograms, `request_success`) are counted when
a request ends, from its RequestMetrics; the scheduler-level ones (running / waiting, KV-cache usage,
prefix-cache queries and hits, preemptions) are read from the engine's `stats()` at each scrape: live for the
in-process engine; with data parallelism (`DataParallelClient`) the sum over the replicas of the snapshots they
push (at most a quarter of a second old, and fresh once a replica goes idle).

Per replica (labelled `replica="0"`, `"1"`, ...; one replica, "0", without data parallelism):
`tessera_replica_requests_running`, `tessera_replica_requests_waiting`, `tessera_replica_kv_blocks_used`
(gauges), `tessera_replica_prefix_cache_queries_total` and `tessera_replica_prefix_cache_hits_total` (counters,
in tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ...outputs import RequestMetrics, RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)

# vLLM v1's buckets (vllm/v1/metrics/loggers.py, PrometheusStatLogger)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value, as vLLM buckets its token-count histograms."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


Stats = Callable[[], dict[str, int]]


def _stats_source(engine: Any) -> tuple[Stats, Callable[[], list[dict[str, int]]]]:
    """(the engine's stats, its replicas' stats): an EngineClient's `stats()` and `replica_stats()` (an
    LLMEngine, which has no `replica_stats()`, counts as one replica)."""
    stats = engine.stats
    replicas = getattr(engine, "replica_stats", None) or (lambda: [stats()])
    return stats, replicas


def _rate(hits: int, queries: int) -> float:
    return hits / queries if queries else 0.0


class ServerMetrics:
    def __init__(self, engine: Any, model_name: Optional[str] = None) -> None:
        """`engine`: what the server serves (an EngineClient), read through its `stats()`."""
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "tessera_requests", "Requests by how they ended: stop, length, abort (client gone) or error (refused)",
            ["status"], registry=registry,
        )  # fmt: skip
        self.time_to_first_token = Histogram(
            "tessera_time_to_first_token_seconds", "Time from arrival to the first output token",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.time_per_output_token = Histogram(
            "tessera_time_per_output_token_seconds", "Mean time between output tokens after the first",
            buckets=_LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "tessera_prompt_tokens", "Prompt tokens (image tokens included)", registry=registry
        )
        self.generation_tokens = Counter("tessera_generation_tokens", "Generated tokens", registry=registry)

        stats, replica_stats = _stats_source(engine)

        def read(name: str) -> Callable[[], float]:
            return lambda: stats().get(name, 0)

        gauges = {
            "tessera_requests_running": ("Sequences being generated", read("running")),
            "tessera_requests_waiting": ("Sequences waiting to be scheduled", read("waiting")),
            "tessera_kv_blocks_used": ("KV cache blocks in use", read("kv_blocks_used")),
            "tessera_kv_blocks_total": ("KV cache blocks in the pool", read("kv_blocks_total")),
            "tessera_state_slots_used": (
                "Recurrent-state rows held by running sequences (hybrid models)", read("state_slots_used")
            ),
            "tessera_state_slots_total": (
                "Recurrent-state rows for running sequences (hybrid models; 0 for others)", read("state_slots_total")
            ),
            "tessera_prefix_cache_hit_rate": (
                "Prompt tokens found in the prefix cache",
                lambda: _rate(*_pick(stats(), "prefix_cache_hits", "prefix_cache_queries")),
            ),
            "tessera_encoder_cache_hit_rate": (
                "Image items found in the encoder cache",
                lambda: _rate(*_pick(stats(), "encoder_cache_hits", "encoder_cache_queries")),
            ),
            "tessera_processor_cache_hit_rate": (
                "Image items found in the processor-output cache",
                lambda: _rate(*_pick(stats(), "processor_cache_hits", "processor_cache_queries")),
            ),  # fmt: skip
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=registry).set_function(read)
        registry.register(_ReplicaSeries(replica_stats))
        self.model_name = model_name or Path(str(engine.model_config.model)).name
        self.vllm = _VllmMetrics(stats, engine.max_model_len, self.model_name, registry)

    def observe_finished(self, output: RequestOutput) -> None:
        """Count a request that ran to its end (or was aborted) and its latencies."""
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        for completion in output.outputs:
            self.requests.labels(completion.finish_reason or "abort").inc()
            self.generation_tokens.inc(len(completion.token_ids))
            metrics = completion.metrics
            if metrics is not None and metrics.time_to_first_token is not None:
                self.time_to_first_token.observe(metrics.time_to_first_token)
            if metrics is not None and metrics.time_per_output_token is not None:
                self.time_per_output_token.observe(metrics.time_per_output_token)
        self.vllm.observe_finished(output)

    def count(self, status: str, n: int = 1) -> None:
        self.requests.labels(status).inc(n)
        if status == "abort":  # a request the engine ran until the client went away ("error": refused, never ran)
            self.vllm.request_success.labels(self.model_name, "abort").inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _VllmMetrics:
    """vLLM v1's Prometheus series (names, kinds, units, buckets), labelled model_name."""

    def __init__(self, stats: Stats, max_model_len: int, model_name: str, registry: CollectorRegistry) -> None:
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str, read) -> None:
            Gauge(name, doc, labels, registry=registry).labels(model_name).set_function(read)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              lambda: stats().get("running", 0))  # fmt: skip
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              lambda: stats().get("waiting", 0))  # fmt: skip

        def kv_usage() -> float:
            return _rate(*_pick(stats(), "kv_blocks_used", "kv_blocks_total"))

        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage)
        gauge("vllm:gpu_cache_usage_perc",
              "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
              kv_usage)  # fmt: skip
        registry.register(_EngineCounters(stats, model_name))

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("vllm:request_success", "Count of successfully processed requests.",
                                       ("finished_reason",))  # fmt: skip
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              VLLM_TTFT_BUCKETS)  # fmt: skip
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds. "
                              "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
                              VLLM_ITL_BUCKETS)  # fmt: skip
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             VLLM_ITL_BUCKETS)  # fmt: skip
        phases = {
            "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
            "queue": ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
            "inference": ("vllm:request_inference_time_seconds",
                          "Histogram of time spent in RUNNING phase for request."),
            "prefill": ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
            "decode": ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
        }  # fmt: skip
        self.phases = {key: histogram(name, doc, VLLM_REQUEST_LATENCY_BUCKETS) for key, (name, doc) in phases.items()}

    def observe_finished(self, output: RequestOutput) -> None:
        """A finished request: vLLM counts each sequence (n > 1 gives n), the prompt once per sequence."""
        name = self.model_name
        num_prompt = len(output.prompt_token_ids)
        for completion in output.outputs:
            num_generated = len(completion.token_ids)
            self.prompt_tokens.labels(name).inc(num_prompt)
            self.generation_tokens.labels(name).inc(num_generated)
            self.request_success.labels(name, completion.finish_reason or "abort").inc()
            self.request_prompt_tokens.labels(name).observe(num_prompt)
            self.request_generation_tokens.labels(name).observe(num_generated)
            metrics = completion.metrics
            if metrics is None:
                continue
            if metrics.time_to_first_token is not None:
                self.ttft.labels(name).observe(metrics.time_to_first_token)
            times = metrics.token_times
            for before, after in zip(times, times[1:]):
                self.itl.labels(name).observe(after - before)
                self.tpot.labels(name).observe(after - before)
            for key, seconds in _phases(metrics).items():
                self.phases[key].labels(name).observe(seconds)


def _phases(m: RequestMetrics) -> dict[str, float]:
    """vLLM's request phases: e2e (arrival to end), queue (arrival to first scheduled), inference (first
    scheduled to end) = prefill (to first token) + decode (first token to end); those known."""
    if m.finished_time is None:
        return {}
    phases = {"e2e": m.finished_time - m.arrival_time}
    if m.first_scheduled_time is not None:
        phases["queue"] = m.first_scheduled_time - m.arrival_time
        phases["inference"] = m.finished_time - m.first_scheduled_time
        if m.first_token_time is not None:
            phases["prefill"] = m.first_token_time - m.first_scheduled_time
            phases["decode"] = m.finished_time - m.first_token_time
    return phases


class _EngineCounters(Collector):
    """Counters the engine keeps itself, read at each scrape: prefix-cache queries and hits (tokens), preemptions."""

    def __init__(self, stats: Stats, model_name: str) -> None:
        self.stats, self.model_name = stats, model_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        now = self.stats()
        queries, hits = now.get("prefix_cache_queries", 0), now.get("prefix_cache_hits", 0)
        series = [
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", hits),
            ("vllm:gpu_prefix_cache_queries", "GPU prefix cache queries, in terms of number of queried tokens. "
             "DEPRECATED: Use vllm:prefix_cache_queries instead.", queries),
            ("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of number of cached tokens. "
             "DEPRECATED: Use vllm:prefix_cache_hits instead.", hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             now.get("num_preemptions", 0)),
        ]  # fmt: skip
        for name, doc, value in series:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class _ReplicaSeries(Collector):
    """Per-replica series (label `replica`), read at each scrape."""

    GAUGES = (
        ("tessera_replica_requests_running", "Sequences being generated, per replica", "running"),
        ("tessera_replica_requests_waiting", "Sequences waiting to be scheduled, per replica", "waiting"),
        ("tessera_replica_kv_blocks_used", "KV cache blocks in use, per replica", "kv_blocks_used"),
    )
    COUNTERS = (
        ("tessera_replica_prefix_cache_queries", "Prefix cache queries (tokens), per replica", "prefix_cache_queries"),
        ("tessera_replica_prefix_cache_hits", "Prefix cache hits (tokens), per replica", "prefix_cache_hits"),
    )

    def __init__(self, replica_stats: Callable[[], list[dict[str, int]]]) -> None:
        self.replica_stats = replica_stats

    def collect(self) -> Iterator[Any]:
        replicas = self.replica_stats()
        for kind, table in ((GaugeMetricFamily, self.GAUGES), (CounterMetricFamily, self.COUNTERS)):
            for name, doc, key in table:
                family = kind(name, doc, labels=["replica"])
                for index, snapshot in enumerate(replicas):
                    family.add_metric([str(index)], snapshot.get(key, 0))
                yield family


def _pick(stats: dict[str, int], *names: str) -> tuple[int, ...]:
    return tuple(stats.get(name, 0) for name in names)
