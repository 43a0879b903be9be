"""Prometheus metrics in a registry of the app's own: requests, tokens, latencies, and the engine's load."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.registry import ModelRegistry

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_REQUEST_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """Per app, not prometheus_client's global registry, so several apps in one process (tests) do not clash."""

    def __init__(self, models: ModelRegistry) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "tern_http_requests", "HTTP requests answered, by route, method and status", ["route", "method", "status"],
            registry=registry,
        )
        self.prompt_tokens = Counter("tern_prompt_tokens", "Prompt tokens submitted to the engine", registry=registry)
        self.completion_tokens = Counter("tern_completion_tokens", "Tokens generated", registry=registry)
        self.time_to_first_token = Histogram(
            "tern_time_to_first_token_seconds", "From submission to a sample's first token",
            buckets=_LATENCY_BUCKETS_S, registry=registry,
        )
        self.inter_token_latency = Histogram(
            "tern_inter_token_latency_seconds", "Between consecutive tokens of one sample",
            buckets=_LATENCY_BUCKETS_S, registry=registry,
        )
        self.e2e_latency = Histogram(
            "tern_e2e_request_latency_seconds", "From submission to a sample's last token",
            buckets=_REQUEST_BUCKETS_S, registry=registry,
        )
        registry.register(_EngineCollector(models))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's own counts, read when scraped (the engine thread owns them; stats() copies them)."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models

    def describe(self):
        return []  # no collect() at registration time, when the engine may not exist yet

    def collect(self):
        engine = self.models.handle().engine
        yield GaugeMetricFamily("tern_model_loaded", "1 once the model is loaded", value=int(engine is not None))
        if engine is None:
            return
        stats = engine.stats()
        yield GaugeMetricFamily("tern_num_requests_running", "Sequences being decoded", value=stats.num_running)
        yield GaugeMetricFamily("tern_num_requests_waiting", "Sequences waiting for a slot", value=stats.num_waiting)
        yield GaugeMetricFamily("tern_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", value=stats.kv_cache_usage)
        yield GaugeMetricFamily("tern_kv_cache_blocks_used", "KV-cache blocks in use", value=stats.num_kv_blocks_used)
        yield GaugeMetricFamily("tern_kv_cache_blocks_free", "KV-cache blocks free", value=stats.num_kv_blocks_free)
        yield GaugeMetricFamily("tern_kv_cache_blocks_reserved", "KV-cache blocks the engine holds for itself (the "
                                "compiled decode step's warm-up, while it runs)", value=stats.num_kv_blocks_reserved)
        yield GaugeMetricFamily("tern_generation_tokens_per_second", "Over the last 5 s", value=stats.tokens_per_s)
        yield CounterMetricFamily("tern_preemptions", "Sequences preempted for KV space", value=stats.num_preemptions)
        yield CounterMetricFamily(
            "tern_prefix_cache_hits", "KV blocks reused from the prefix cache instead of recomputed",
            value=stats.num_prefix_cache_hits,
        )
        yield CounterMetricFamily("tern_engine_steps", "Model steps run, for the API and the UI", value=stats.num_steps)
        decode_steps = CounterMetricFamily(
            "tern_decode_steps", "Decode steps run, by the step that ran them (native, compiled, graphs, eager)",
            labels=["step"])
        for step, count in sorted(stats.decode_steps.items()):
            decode_steps.add_metric([step], count)
        yield decode_steps
        yield CounterMetricFamily(
            "tern_engine_generated_tokens", "Tokens sampled, for the API and the UI", value=stats.num_generated_tokens
        )
