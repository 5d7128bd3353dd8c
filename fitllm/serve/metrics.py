"""Prometheus metrics of the server: request counts, tokens, latencies, and the engine's gauges.

Each app gets its own registry (tests build several apps in one process). Engine gauges are read
from `stats()` at scrape time, so they can never go stale or drift from the engine's own view.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0)

# stats() key -> (metric name, help, kind)
ENGINE_STATS = {
    "num_running": ("fitllm_num_requests_running", "Requests the engine is running", "gauge"),
    "num_waiting": ("fitllm_num_requests_waiting", "Requests waiting for admission (queue length)", "gauge"),
    "kv_blocks_used": ("fitllm_kv_blocks_used", "KV-cache blocks in use (a split cache: pages)", "gauge"),
    "kv_blocks_total": ("fitllm_kv_blocks_total", "KV-cache blocks in the pool (a split cache: pages)", "gauge"),
    "kv_window_pages_used": ("fitllm_kv_window_pages_used",
                             "Pages of a split cache the sliding-window layers' blocks hold (--kv-layout split)",
                             "gauge"),
    "prefix_cache_hit_rate": ("fitllm_prefix_cache_hit_rate", "Share of prompt tokens found in the prefix cache",
                              "gauge"),
    "preemptions": ("fitllm_preemptions", "Requests preempted for lack of KV blocks", "counter"),
    "spec_acceptance_rate": ("fitllm_spec_acceptance_rate", "Share of drafted tokens the target accepted", "gauge"),
    "spec_mean_accepted_len": ("fitllm_spec_mean_accepted_len", "Tokens gained per verification step", "gauge"),
}


class EngineCollector:
    """Turns the engine's stats() dict into gauges on every scrape."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        try:
            stats = self.stats()
        except Exception:  # a scrape must never fail because the engine is shutting down
            return
        for key, (name, doc, kind) in ENGINE_STATS.items():
            value = stats.get(key)
            if value is None:
                continue
            family = CounterMetricFamily(name, doc) if kind == "counter" else GaugeMetricFamily(name, doc)
            family.add_metric([], float(value))
            yield family


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("fitllm_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("fitllm_prompt_tokens", "Prompt tokens of requests the engine took (per choice)",
                                     registry=r)
        self.generation_tokens = Counter("fitllm_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("fitllm_time_to_first_token_seconds", "Request arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("fitllm_inter_token_latency_seconds", "Time between generated tokens of a request",
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("fitllm_e2e_request_latency_seconds", "Request arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.errors = Counter("fitllm_request_errors", "Requests answered with an error, by error code",
                              ["type"], registry=r)
        r.register(EngineCollector(stats))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
