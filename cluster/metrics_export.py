"""Prometheus text for the driver's `metrics` map (driver/api/serving_metrics.py, in the `stats` reply). Names are
vLLM's under a `lockstep:` prefix, so dashboards need only the prefix changed; behind a replica router every series
also has a `replica` label, and `merge` gives the summed map. Torch-free."""

from __future__ import annotations

from collections import Counter
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
    # speculative decoding (docs/speculative.md): 0 when the preset sets none
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Rows that carried proposals into a verifying forward."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Proposed tokens verified."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Proposed tokens accepted."),
)
PER_POS = "spec_decode_num_accepted_tokens_per_pos"  # a counter by `position` in the draft (a list in the map)
HISTOGRAMS = (
    ("time_to_first_token_seconds", "time_to_first_token_seconds", "Time from arrival to the first token."),
    ("inter_token_latency_seconds", "inter_token_latency_seconds", "Time between two tokens of a request."),
    ("time_per_output_token_seconds", "inter_token_latency_seconds",
     "Time between two tokens of a request (vLLM's older name)."),
    ("e2e_request_latency_seconds", "e2e_request_latency_seconds", "Time from arrival to the last output."),
)


class MetricsSnapshot(Collector):
    """The families of {replica label: `metrics` map} (label None: a single driver, no `replica` label)."""

    def __init__(self, maps: dict[str | None, dict[str, Any]], model_name: str):
        self.maps, self.model_name = maps, model_name
        self.names = ["model_name"] + (["replica"] if None not in maps else [])

    def _labels(self, replica: str | None) -> list[str]:
        return [self.model_name] + ([replica] if replica is not None else [])

    def collect(self) -> Iterator[Metric]:
        for family, table in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
            for name, key, doc in table:
                fam = family(PREFIX + name, doc, labels=self.names)
                for replica, m in self.maps.items():
                    fam.add_metric(self._labels(replica), float(m.get(key, 0)))
                yield fam
        success = CounterMetricFamily(PREFIX + "request_success", "Requests that ended, by finish reason.",
                                      labels=self.names + ["finished_reason"])
        for replica, m in self.maps.items():
            for reason, n in sorted(m.get("request_success", {}).items()):
                success.add_metric(self._labels(replica) + [reason], float(n))
        yield success
        per_pos = CounterMetricFamily(PREFIX + PER_POS, "Proposed tokens accepted, by position in the draft.",
                                      labels=self.names + ["position"])
        for replica, m in self.maps.items():
            for pos, n in enumerate(m.get(PER_POS, [])):
                per_pos.add_metric(self._labels(replica) + [str(pos)], float(n))
        yield per_pos
        for name, key, doc in HISTOGRAMS:
            fam = HistogramMetricFamily(PREFIX + name, doc, labels=self.names)
            for replica, m in self.maps.items():
                h = m.get(key) or {"buckets": [["+Inf", 0]], "sum": 0.0}
                buckets = [(b if b == "+Inf" else repr(float(b)), float(n)) for b, n in h["buckets"]]
                fam.add_metric(self._labels(replica), buckets, float(h["sum"]))
            yield fam


def merge(maps: list[dict[str, Any]]) -> dict[str, Any]:
    """One `metrics` map for several drivers: counts, gauges of requests and histograms summed (bucket by
    bucket), KV cache usage averaged, the lowest weight version (every replica serves at least it)."""
    out: dict[str, Any] = {}
    if not maps:
        return out
    for key in ("num_requests_running", "num_requests_waiting", "restart_count", *(k for _, k, _ in COUNTERS)):
        out[key] = sum(m.get(key, 0) for m in maps)
    out["kv_cache_usage_perc"] = sum(m.get("kv_cache_usage_perc", 0.0) for m in maps) / len(maps)
    out["weight_version"] = min(m.get("weight_version", 0) for m in maps)
    success: Counter = Counter()
    for m in maps:
        success.update(m.get("request_success", {}))
    out["request_success"] = dict(success)
    width = max(len(m.get(PER_POS, [])) for m in maps)
    if width:
        out[PER_POS] = [sum(m[PER_POS][p] for m in maps if p < len(m.get(PER_POS, []))) for p in range(width)]
    for _, key, _ in HISTOGRAMS:
        hs = [m[key] for m in maps if m.get(key)]
        if hs:
            out[key] = {"buckets": [[b, sum(h["buckets"][i][1] for h in hs)]
                                    for i, (b, _) in enumerate(hs[0]["buckets"])],
                        "sum": sum(h["sum"] for h in hs), "count": sum(h["count"] for h in hs)}
    return out


def render(stats: dict[str, Any], model_name: str) -> bytes:
    """The Prometheus text exposition of a `stats` reply's metrics (a driver's, or a router's per replica)."""
    maps: dict[str | None, dict[str, Any]] = {None: stats.get("metrics", {})}
    if "replicas" in stats:  # one map per replica, labelled by its index
        maps = {str(r.get("index", i)): (r.get("stats") or {}).get("metrics", {})
                for i, r in enumerate(stats["replicas"])}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsSnapshot(maps, model_name))
    return generate_latest(registry)
