"""Serving metrics measured on the driver: request latencies, token counts and finish reasons. The loop thread
feeds `observe(req)` (DriverLoop.emit), a few additions and a bisect a call; the front door reads `snapshot` for
the `metrics` map of the `stats` reply (docs/protocol.md), which the HTTP gateway turns into Prometheus text."""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cluster.outputs import RequestStatus

# seconds; vLLM's bounds for the same histograms
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass
class Histogram:
    """Counts per bucket (not cumulative; the last one is +Inf), their sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def to_dict(self) -> dict[str, Any]:
        """`buckets`: [upper bound, cumulative count] pairs (the last bound is "+Inf"), `sum`, `count`."""
        cumulative = [[bound, n] for bound, n in zip((*self.bounds, "+Inf"), itertools.accumulate(self.counts))]
        return {"buckets": cumulative, "sum": self.total, "count": self.count}


@dataclass
class _Seen:
    tokens: int = 0  # generated tokens already counted
    last: float = 0.0  # when the last of them arrived


def finish_reason(req: Any) -> str:
    """Why a finished request ended: its own `finish_reason`, else from its status and its last token."""
    own = getattr(req, "finish_reason", None)
    if own:
        return own
    if req.status == RequestStatus.CANCELLED:
        return "cancelled"
    if req.status == RequestStatus.FAILED:
        return "error"
    if req.generated and req.generated[-1] in req.eos_token_ids:
        return "stop"
    return "length"


class ServingMetrics:
    """Counters and histograms of the requests the driver served since it started."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the loop thread writes, the front door's thread reads
        self.ttft, self.itl, self.e2e = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS), Histogram(E2E_BUCKETS)
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = self.generation_tokens = 0
        self.live: dict[Any, _Seen] = {}  # by request (identity)

    def observe(self, req: Any) -> None:
        """A request got tokens or ended (the driver's loop thread)."""
        now = time.perf_counter()
        with self.lock:
            seen = self.live.get(req)
            if seen is None:
                seen = self.live[req] = _Seen(last=req.created_time)
            new = len(req.generated) - seen.tokens
            if new > 0:
                if seen.tokens == 0:
                    self.ttft.observe(now - req.created_time)
                    self.prompt_tokens += len(req.prompt_ids)
                else:
                    self.itl.observe((now - seen.last) / new)
                self.generation_tokens += new
                seen.tokens, seen.last = len(req.generated), now
            if req.is_finished:
                del self.live[req]
                if seen.tokens == 0 and req.status == RequestStatus.FINISHED:
                    self.prompt_tokens += len(req.prompt_ids)
                self.e2e.observe(now - req.created_time)
                reason = finish_reason(req)
                self.finished[reason] = self.finished.get(reason, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """The `metrics` map's request part: token counters, finish reasons and the three histograms."""
        with self.lock:
            return {"prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
                    "request_success": dict(self.finished), "time_to_first_token_seconds": self.ttft.to_dict(),
                    "inter_token_latency_seconds": self.itl.to_dict(),
                    "e2e_request_latency_seconds": self.e2e.to_dict()}


def metrics_map(manager: Any) -> dict[str, Any]:
    """The `stats` reply's `metrics`: request metrics plus engine gauges (driver; plain reads from the front door)."""
    engine = manager.engine
    blocks, scheduler, page = engine.blocks, engine.scheduler, engine.blocks.page_size
    return manager.metrics.snapshot() | {
        "num_requests_running": len(scheduler.running), "num_requests_waiting": len(scheduler.waiting),
        "kv_cache_usage_perc": 1.0 - blocks.num_free / max(1, blocks.num_blocks),
        "prefix_cache_queries": blocks.prefix_query_blocks * page,
        "prefix_cache_hits": blocks.prefix_hit_blocks * page,
        "num_preemptions": scheduler.num_preemptions, "weight_version": engine.weight_version,
        "restart_count": manager.restart_count, **spec_metrics(engine)}


def spec_metrics(engine: Any) -> dict[str, Any]:
    """vLLM's spec-decode counters (driver/engine/speculation.py), empty when the engine does not speculate."""
    if engine.spec is None:
        return {}
    s = engine.spec.stats
    return {"spec_decode_num_drafts": s.drafts, "spec_decode_num_draft_tokens": s.draft_tokens,
            "spec_decode_num_accepted_tokens": s.accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(s.accepted_per_pos)}
