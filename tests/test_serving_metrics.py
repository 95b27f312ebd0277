"""driver/api/serving_metrics.py on hand-made requests: what each output adds, histogram buckets, finish reasons."""

from __future__ import annotations

import time

from cluster.outputs import RequestStatus
from driver.engine.request import Request
from driver.api.serving_metrics import Histogram, ServingMetrics


def test_histogram_buckets_are_cumulative_with_le_bounds():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    d = h.to_dict()
    assert d["buckets"] == [[0.1, 2], [1.0, 3], ["+Inf", 4]]
    assert d["count"] == 4 and abs(d["sum"] - 3.65) < 1e-9


def test_tokens_latencies_and_finish_reasons():
    m = ServingMetrics()
    a = Request("a", [1, 2, 3], max_new_tokens=3, eos_token_ids=frozenset({2}))
    a.created_time = time.perf_counter() - 0.2
    for tok in (7, 8):  # two outputs, one token each
        a.generated.append(tok)
        a.status = RequestStatus.DECODING
        m.observe(a)
    a.generated.append(2)  # EOS: finished with "stop"
    a.status = RequestStatus.FINISHED
    m.observe(a)
    b = Request("b", [4, 5], max_new_tokens=1)
    b.generated.append(9)
    b.status = RequestStatus.FINISHED  # one output: its first token and its end
    m.observe(b)
    c = Request("c", [6], max_new_tokens=5)
    c.status = RequestStatus.CANCELLED  # cancelled before any token
    m.observe(c)
    s = m.snapshot()
    assert s["prompt_tokens"] == 5 and s["generation_tokens"] == 4  # c never started: its prompt is not counted
    assert s["request_success"] == {"stop": 1, "length": 1, "cancelled": 1, "error": 0}
    assert s["time_to_first_token_seconds"]["count"] == 2
    assert s["time_to_first_token_seconds"]["sum"] >= 0.2  # a arrived 0.2 s before its first token
    assert s["inter_token_latency_seconds"]["count"] == 2  # a's second and third tokens
    assert s["e2e_request_latency_seconds"]["count"] == 3
    assert not m.live  # nothing is kept for requests that ended
