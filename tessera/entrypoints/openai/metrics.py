"""Prometheus metrics of the server (`GET /metrics`), in a registry of its own per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ...engine.llm_engine import LLMEngine
from ...outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, engine: LLMEngine) -> None:
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

        scheduler, blocks = engine.scheduler, engine.block_manager
        gauges = {
            "tessera_requests_running": ("Sequences being generated", lambda: len(scheduler.running)),
            "tessera_requests_waiting": ("Sequences waiting to be scheduled", lambda: len(scheduler.waiting)),
            "tessera_kv_blocks_used": ("KV cache blocks in use", lambda: blocks.num_blocks - blocks.num_free_blocks),
            "tessera_kv_blocks_total": ("KV cache blocks in the pool", lambda: blocks.num_blocks),
            "tessera_prefix_cache_hit_rate": (
                "Prompt tokens found in the prefix cache",
                lambda: blocks.prefix_hit_rate,
            ),
            "tessera_encoder_cache_hit_rate": (
                "Image items found in the encoder cache",
                lambda: engine.encoder_cache.hits / max(engine.encoder_cache.queries, 1),
            ),
            "tessera_processor_cache_hit_rate": (
                "Image items found in the processor-output cache",
                lambda: _processor_hit_rate(engine),
            ),  # fmt: skip
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=registry).set_function(read)

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

    def count(self, status: str, n: int = 1) -> None:
        self.requests.labels(status).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _processor_hit_rate(engine: LLMEngine) -> float:
    cache = getattr(engine.processor, "cache", None)
    return cache.stats.hit_rate if cache is not None else 0.0
