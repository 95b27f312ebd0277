"""Releasing and resuming memory on every rank (TP=1 directly, TP=2 under torchrun), decode graphs captured by the
CPU stand-in: a release outside a pause (refused), the KV cache alone with requests in flight (preempted, then
recomputed), KV cache and weights kept on the host, weights with no host copy (resume refused until a checkpoint
update fills them), and the serving pause's path (the driver's call through its loop). Each rank writes a record;
the test compares tokens with transformers and checks each rank's memory figures."""

from __future__ import annotations

import json
import sys
import time

import cluster
from cluster.errors import MemoryCallRefused
from worker.graphs import EagerStandIn

NEW, LONG = 12, 100
# a KV cache far above glibc's mmap threshold, so what is freed leaves the resident set (docs/weights.md)
CFG = dict(page_size=16, num_blocks=4096, max_batch_tokens=64, max_requests_per_batch=8)
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [17, 33, 250, 9, 400, 77, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
           [1500, 3, 1200]]
LONG_PROMPTS = [[11, 12, 13], [900, 901, 902, 903, 904, 905]]


def outcome(call, *args, **kwargs) -> dict:
    """What a memory call returned on this rank, or the refusal it raised (type, code, first refusing rank)."""
    try:
        return {"raised": None, "result": call(*args, **kwargs)}
    except MemoryCallRefused as e:
        return {"raised": type(e).__name__, "code": e.code, "rank": e.rank}


def tokens(m, ids) -> list[list[int]]:
    return [m.get_result(i, timeout=300).generated_tokens for i in ids] if m.is_driver else []


def graphs(m) -> dict:
    """This rank's decode graphs after generating: captures so far, drops, and the address check."""
    g = m.runner.graph_stats
    return {"captures": g["captures"], "drops": g.get("drops", 0), "moved": m.runner.check_graph_addresses()}


def run(model_dir: str) -> dict:
    model = cluster.load(model_dir)
    model.graph_factory = EagerStandIn
    rank = model.groups.rank
    rec: dict = {"rank": rank}
    with model.continuous_batching_context_manager(
            continuous_batching_config=cluster.ContinuousBatchingConfig(**CFG)) as m:
        rec["before"] = tokens(m, m.add_requests(PROMPTS, max_new_tokens=NEW))
        rec["graphs_before"] = graphs(m)
        rec["not_paused"] = outcome(m.release_memory)  # refused on the driver; a worker's is a no-op (None)

        # 1. the KV cache alone, with requests in flight: they are preempted and recomputed after the resume
        inflight = m.add_requests(LONG_PROMPTS, max_new_tokens=LONG)
        while m.is_driver and m.stats()["tokens_generated"] < NEW * len(PROMPTS) + 4:
            time.sleep(0.005)  # a bounded wait: the requests finish by themselves otherwise
        with m.pause():
            rec["kv"] = outcome(m.release_memory, ("kv_cache",))
            rec["running_after_release"] = m.stats().get("running")
            rec["preempted"] = m.stats().get("preemptions")
            queued = m.add_requests(PROMPTS, max_new_tokens=NEW)
        with m.pause():
            rec["steps_held"] = m.stats().get("running") == 0 and m.memory.released == ["kv_cache"]
            rec["kv_resume"] = outcome(m.resume_memory, ("kv_cache",))
        rec["inflight"], rec["after_kv"] = tokens(m, inflight), tokens(m, queued)
        rec["graphs_after_kv"] = graphs(m)

        # 2. KV cache and weights, the weights waiting in host memory
        with m.pause():
            rec["both_host"] = outcome(m.release_memory, ("kv_cache", "weights"), keep_weights_on_host=True)
            queued = m.add_requests(PROMPTS, max_new_tokens=NEW)
        with m.pause():
            rec["both_host_resume"] = outcome(m.resume_memory)
        rec["after_host"] = tokens(m, queued)

        # 3. weights with no host copy: a resume is refused (nothing changes) until an update fills them
        with m.pause():
            rec["no_host"] = outcome(m.release_memory, ("kv_cache", "weights"), keep_weights_on_host=False)
            rec["refused_resume"] = outcome(m.resume_memory)
            rec["still_released"] = m.memory.released
            rec["update"] = m.update_weights(model_dir)["ok"]
            rec["no_host_resume"] = outcome(m.resume_memory)
        rec["after_update"] = tokens(m, m.add_requests(PROMPTS, max_new_tokens=NEW))

        # 4. the serving pause's path: the driver's calls go through its loop as CALL plans; workers run their share
        if m.is_driver:
            m.hold_scheduling(True)
            rec["held_release"] = outcome(m.release_memory, ("kv_cache", "weights"), keep_weights_on_host=True)
            queued = m.add_requests(PROMPTS, max_new_tokens=NEW)
            rec["held_resume"] = outcome(m.resume_memory)
            m.hold_scheduling(False)
            rec["after_held"] = tokens(m, queued)
        with m.pause():  # every rank: the driver's held calls are done before this park
            rec["released_at_end"] = m.memory.released
        rec["graphs_end"] = graphs(m)
    return rec


if __name__ == "__main__":
    record = run(sys.argv[1])
    with open(f"{sys.argv[2]}/memory.rank{record['rank']}.json", "w") as f:
        json.dump(record, f)
