"""Prometheus text for the driver's `metrics` map (driver/serving_metrics.py, in the `stats` reply).

Names follow vLLM's under a `lockstep:` prefix, each labelled with `model_name`, so existing dashboards need only
the prefix changed; `gpu_cache_usage_perc` and `time_per_output_token_seconds` repeat `kv_cache_usage_perc` and
`inter_token_latency_seconds` under their older vLLM names. Torch-free.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "lockstep:"

# (metric name, key in the metrics map, help)
GAUGES = (
    ("num_requests_running", "num_requests_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_requests_waiting", "Requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full)."),
    ("gpu_cache_usage_perc", "kv_cache_usage_perc", "Fraction of KV cache pages in use (vLLM's older name)."),
    ("weight_version", "weight_version", "Version of the weights served (bumped by each update)."),
    ("restart_count", "restart_count", "Restarts of the rank group by its launcher."),
)
COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "num_preemptions", "Requests preempted to free KV cache pages."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens of the requests that started generating."),
    ("generation_tokens", "generation_tokens", "Tokens generated."),
)
HISTOGRAMS = (
    ("time_to_first_token_seconds", "time_to_first_token_seconds", "Time from arrival to the first token."),
    ("inter_token_latency_seconds", "inter_token_latency_seconds", "Time between two tokens of a request."),
    ("time_per_output_token_seconds", "inter_token_latency_seconds",
     "Time between two tokens of a request (vLLM's older name)."),
    ("e2e_request_latency_seconds", "e2e_request_latency_seconds", "Time from arrival to the last output."),
)


class MetricsSnapshot(Collector):
    """The families of one `metrics` map (collected once per scrape)."""

    def __init__(self, metrics: dict[str, Any], model_name: str):
        self.metrics, self.model_name = metrics, model_name

    def collect(self) -> Iterator[Metric]:
        m, labels = self.metrics, [self.model_name]
        for name, key, doc in GAUGES:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(labels, float(m.get(key, 0)))
            yield g
        for name, key, doc in COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(labels, float(m.get(key, 0)))
            yield c
        success = CounterMetricFamily(PREFIX + "request_success", "Requests that ended, by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, n in sorted(m.get("request_success", {}).items()):
            success.add_metric([self.model_name, reason], float(n))
        yield success
        for name, key, doc in HISTOGRAMS:
            h = m.get(key) or {"buckets": [["+Inf", 0]], "sum": 0.0}
            fam = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
            fam.add_metric(labels, [(_bound(b), float(n)) for b, n in h["buckets"]], float(h["sum"]))
            yield fam


def _bound(b: float | str) -> str:
    return "+Inf" if b == "+Inf" else repr(float(b))


def render(metrics: dict[str, Any], model_name: str) -> bytes:
    """The Prometheus text exposition of a `metrics` map."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsSnapshot(metrics, model_name))
    return generate_latest(registry)
