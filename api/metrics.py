"""Prometheus metrics in a registry of the app's own: requests, tokens, latencies, and each model's engine and load
state. Every model series carries a `model` label (the id a request names)."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, GCCollector, Histogram,
                               ProcessCollector, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.registry import LOADED, LOADING, UNLOADED, UNLOADING, FAILED, ModelRegistry

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_REQUEST_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_STATES = (LOADED, LOADING, UNLOADED, UNLOADING, FAILED)

CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(frozen=True)
class ModelMetrics:
    """One model's request series (what api/generation.py counts), already labelled with its id."""

    prompt_tokens: Counter
    completion_tokens: Counter
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_latency: Histogram


class Metrics:
    """Per app, not prometheus_client's global registry, so several apps in one process (tests) do not clash."""

    def __init__(self, models: ModelRegistry) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "tern_http_requests", "HTTP requests answered, by route, method, status and the model asked for (empty: "
            "none, or an unknown one)", ["route", "method", "status", "model"], registry=registry,
        )
        self.prompt_tokens = Counter("tern_prompt_tokens", "Prompt tokens submitted to the engine", ["model"],
                                     registry=registry)
        self.completion_tokens = Counter("tern_completion_tokens", "Tokens generated", ["model"], registry=registry)
        self.time_to_first_token = Histogram(
            "tern_time_to_first_token_seconds", "From submission to a sample's first token", ["model"],
            buckets=_LATENCY_BUCKETS_S, registry=registry,
        )
        self.inter_token_latency = Histogram(
            "tern_inter_token_latency_seconds", "Between consecutive tokens of one sample", ["model"],
            buckets=_LATENCY_BUCKETS_S, registry=registry,
        )
        self.e2e_latency = Histogram(
            "tern_e2e_request_latency_seconds", "From submission to a sample's last token", ["model"],
            buckets=_REQUEST_BUCKETS_S, registry=registry,
        )
        registry.register(_ModelsCollector(models))
        # What prometheus_client's default registry would have: the process's memory, CPU seconds and start time
        # (process_*), and the garbage collector's collections per generation (python_gc_*).
        ProcessCollector(registry=registry)
        GCCollector(registry=registry)

    def of(self, model_id: str) -> ModelMetrics:
        return ModelMetrics(*(series.labels(model_id) for series in (
            self.prompt_tokens, self.completion_tokens, self.time_to_first_token, self.inter_token_latency,
            self.e2e_latency)))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ModelsCollector:
    """Each model's load state and its engine's own counts, read when scraped (the engine thread owns them; stats()
    copies them)."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models

    def describe(self):
        return []  # no collect() at registration time, when no engine exists yet

    def collect(self):
        statuses = self.models.statuses()
        loaded = GaugeMetricFamily("tern_model_loaded", "1 while the model is loaded", labels=["model"])
        state = GaugeMetricFamily("tern_model_state", "1 for the model's state now", labels=["model", "state"])
        loads = CounterMetricFamily("tern_model_loads", "Times the model was loaded", labels=["model"])
        unloads = CounterMetricFamily("tern_model_unloads", "Times the model was unloaded, by reason: idle (its "
                                      "keep-alive passed) or evicted (room for another under --max-loaded)",
                                      labels=["model", "reason"])
        load_seconds = CounterMetricFamily("tern_model_load_seconds", "Seconds spent loading the model, every load "
                                           "added up (over tern_model_loads_total: the mean load)", labels=["model"])
        leases = GaugeMetricFamily("tern_model_leases", "Requests holding the model loaded now (from their lookup of "
                                   "it until their response has ended)", labels=["model"])
        for status in statuses:
            loaded.add_metric([status.id], int(status.state == LOADED))
            for name in _STATES:
                state.add_metric([status.id, name], int(status.state == name))
            loads.add_metric([status.id], status.num_loads)
            for reason in ("idle", "evicted"):
                unloads.add_metric([status.id, reason], status.unloads_by_reason.get(reason, 0))
            load_seconds.add_metric([status.id], status.total_load_s)
            leases.add_metric([status.id], status.num_leases)
        yield from (loaded, state, loads, unloads, load_seconds, leases)
        yield from _engine_families([(s.id, self.models.handle(s.id).engine) for s in statuses])


def _engine_families(engines: list[tuple[str, object]]):
    """The loaded engines' counts, one sample per model."""
    families = {
        "running": GaugeMetricFamily("tern_num_requests_running", "Sequences being decoded", labels=["model"]),
        "waiting": GaugeMetricFamily("tern_num_requests_waiting", "Sequences waiting for a slot", labels=["model"]),
        "usage": GaugeMetricFamily("tern_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", labels=["model"]),
        "used": GaugeMetricFamily("tern_kv_cache_blocks_used", "KV-cache blocks in use", labels=["model"]),
        "free": GaugeMetricFamily("tern_kv_cache_blocks_free", "KV-cache blocks free", labels=["model"]),
        "reserved": GaugeMetricFamily("tern_kv_cache_blocks_reserved", "KV-cache blocks the engine holds for itself "
                                      "(the compiled decode step's warm-up, while it runs)", labels=["model"]),
        "speed": GaugeMetricFamily("tern_generation_tokens_per_second", "Over the last 5 s", labels=["model"]),
        "preemptions": CounterMetricFamily("tern_preemptions", "Sequences preempted for KV space", labels=["model"]),
        "prefix": CounterMetricFamily("tern_prefix_cache_hits", "KV blocks reused from the prefix cache instead of "
                                      "recomputed", labels=["model"]),
        "steps": CounterMetricFamily("tern_engine_steps", "Model steps run, for the API and the UI", labels=["model"]),
        "decode": CounterMetricFamily("tern_decode_steps", "Decode steps run, by the step that ran them (native, "
                                      "compiled, graphs, eager)", labels=["model", "step"]),
        "generated": CounterMetricFamily("tern_engine_generated_tokens", "Tokens sampled, for the API and the UI",
                                         labels=["model"]),
    }
    for model_id, engine in engines:
        if engine is None:
            continue
        stats = engine.stats()
        for key, value in (("running", stats.num_running), ("waiting", stats.num_waiting),
                           ("usage", stats.kv_cache_usage), ("used", stats.num_kv_blocks_used),
                           ("free", stats.num_kv_blocks_free), ("reserved", stats.num_kv_blocks_reserved),
                           ("speed", stats.tokens_per_s), ("preemptions", stats.num_preemptions),
                           ("prefix", stats.num_prefix_cache_hits), ("steps", stats.num_steps),
                           ("generated", stats.num_generated_tokens)):
            families[key].add_metric([model_id], value)
        for step, count in sorted(stats.decode_steps.items()):
            families["decode"].add_metric([model_id, step], count)
    yield from families.values()
