"""Pause modes and staleness on every rank (TP=1 directly, TP=2 under torchrun): each mode of `manager.pause` with
requests running and waiting, a weight update inside the pause (A and B alternate) and requests added during it;
then `max_weight_lag` at an update made under load (end, restart, within the bound). Rank 0 writes a record the
test checks against transformers."""

from __future__ import annotations

import json
import sys
import time

import cluster
from cluster.errors import RequestRejected
from tests.scripts.update_rank import prompts, wait_tokens

MODES = ("keep", "abort", "wait", "retract")
CFG = dict(page_size=16, max_batch_tokens=128, max_requests_per_batch=4)  # 4 run, the rest wait
N, NEW = 8, 24  # requests in flight at each pause, tokens each
# the staleness scenario's requests, in order: the first 4 run at the update, the last 2 wait (they have no tokens yet)
BOUNDS = [("within", dict(max_weight_lag=1)), ("end", dict(max_weight_lag=0)),
          ("restart", dict(max_weight_lag=0, stale_policy="restart")), ("end", dict(max_weight_lag=0)),
          ("unstarted", dict(max_weight_lag=0)), ("unstarted", dict(max_weight_lag=0, stale_policy="restart"))]


def run(dir_a: str, dir_b: str, work: str) -> dict:
    model = cluster.load(dir_a)
    rec: dict = {"rank": model.groups.rank, "dirs": [dir_a]}  # dirs[v]: the checkpoint of weight version v
    cfg = cluster.ContinuousBatchingConfig(**CFG)
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        for k, mode in enumerate(MODES):
            mark = m.stats().get("tokens_generated", 0)
            ids = m.add_requests(prompts(N, 10 + k), max_new_tokens=NEW)
            wait_tokens(m, mark + 8)  # the 4 running ones have tokens; 4 wait
            target = dir_b if k % 2 == 0 else dir_a
            with m.pause(mode):
                inside: dict = {}
                if m.is_driver:  # the loop is parked: its state can be read here
                    s = m.engine.scheduler
                    inside = {"running": len(s.running), "waiting": len(s.waiting)}
                m.update_weights(target)
                during = m.add_requests(prompts(2, 20 + k), max_new_tokens=NEW)
                if m.is_driver:  # queued, never admitted while the pause lasts
                    inside["during_untouched"] = all(m.requests[r].status == cluster.RequestStatus.PENDING
                                                     and not m.requests[r].generated for r in during)
                    time.sleep(0.3)
                    inside["during_still_untouched"] = all(not m.requests[r].generated for r in during)
            rec["dirs"].append(target)
            rec[mode] = {"inside": inside, "outs": detailed(m, ids), "during": detailed(m, during),
                         "prompts": prompts(N, 10 + k), "during_prompts": prompts(2, 20 + k)}
        # staleness: an update (queued, not in a pause) while requests of each bound run
        mark = m.stats().get("tokens_generated", 0)
        ids = [m.add_request(p, max_new_tokens=NEW, **kw) for p, (_, kw) in zip(prompts(len(BOUNDS), 30), BOUNDS)]
        wait_tokens(m, mark + 8)
        rec["update"] = m.update_weights(dir_b)
        rec["dirs"].append(dir_b)
        rec["stale"] = {"outs": detailed(m, ids), "prompts": prompts(len(BOUNDS), 30), "kinds": [k for k, _ in BOUNDS]}
        if m.is_driver:
            try:
                m.add_request([5, 6, 7], max_new_tokens=4, streaming=True, max_weight_lag=0, stale_policy="restart")
                rec["streaming_restart"] = None
            except RequestRejected as e:
                rec["streaming_restart"] = e.code
        rec["stats"] = m.stats()
    return rec


def detailed(m, ids) -> list[dict]:
    """Each request's final output: tokens, versions, status, finish reason, the pauses it noted, its restarts."""
    if not m.is_driver:
        return []
    outs = [m.get_result(i, timeout=300) for i in ids]
    return [{"id": o.request_id, "prompt": o.prompt_ids, "tokens": o.generated_tokens, "status": int(o.status),
             "versions": [list(v) for v in o.weight_versions], "finish_reason": o.finish_reason,
             "pauses": [list(p) for p in o.pauses or []], "stale_restarts": o.stale_restarts} for o in outs]


if __name__ == "__main__":
    record = run(sys.argv[1], sys.argv[2], sys.argv[3])
    with open(f"{sys.argv[3]}/pause_modes.rank{record['rank']}.json", "w") as f:
        json.dump(record, f)
