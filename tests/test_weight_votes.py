"""Weight updates stay all-or-none and fail loudly at TP=2 (real processes, injected faults on rank 1):
a refusal raises WeightUpdateError on every rank (the front door's path gets a dict naming the rank), an
exception with an empty message votes against, a rank holding another weight version votes against naming
both numbers, versions move on every rank, and a rank that fails while copying makes every rank raise
WeightsDiverged and ends the loop."""

from __future__ import annotations

from cluster.outputs import RequestStatus
from tests.conftest import hf_greedy, read_json, run_ranks
from tests.scripts.update_faults_rank import FAULTS
from tests.scripts.update_rank import prompts


def test_refusals_votes_versions_divergence_tp2(make_checkpoint, tmp_path):
    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    out = tmp_path / "rec"
    proc = run_ranks("update_faults_rank.py", [str(dir_a), str(dir_b), str(out)], timeout=240,
                     env={"LOCKSTEP_FAULTS": FAULTS})
    recs = [read_json(f"{out}.rank{r}") for r in range(2)]
    driver = recs[0]

    # 1. the front door's path: a refused result that names the first refusing rank
    assert driver["async"]["ok"] is False and driver["async"]["rank"] == 1, driver["async"]
    assert "rank 1: InjectedFault" in driver["async"]["error"]
    for rec in recs:
        # 2. a refusal raises the same typed error on every rank, naming rank 1
        r = rec["refused"]
        assert r["raised"] == "WeightUpdateError" and r["code"] == "weight_update_failed", r
        assert r["rank"] == 1 and "rank 1: InjectedFault" in r["message"], r
        assert r["message"] == recs[0]["refused"]["message"]
        # 3. an exception with an empty message is a vote against, not a silent "ok"
        s = rec["silent"]
        assert s["raised"] == "WeightUpdateError" and s["rank"] == 1, s
        assert "rank 1: ValueError (no message)" in s["message"], s
        # 4. rank 1 holds version 7 while the plan carries 0: it votes against, naming both numbers
        v = rec["version"]
        assert v["raised"] == "WeightUpdateError" and v["rank"] == 1, v
        assert "version 7" in v["message"] and "carries 0" in v["message"], v
        # 5. and 6. applied updates move every rank's version (loop path, then inside a pause)
        assert rec["applied"]["raised"] is None and rec["applied"]["result"]["version"] == 1, rec["applied"]
        assert rec["version_after_applied"] == 1
        assert rec["paused"]["raised"] is None and rec["paused"]["result"]["version"] == 2, rec["paused"]
        assert rec["version_after_paused"] == 2
        # 7. a failure half-way through the copy: every rank raises WeightsDiverged and its loop ends
        d = rec["diverged"]
        assert d["raised"] == "WeightsDiverged" and d["code"] == "weights_diverged", d
        assert "rank 1: InjectedFault" in d["message"] and "rank 0" not in d["message"], d
        assert rec["loop_running_after"] is False
        assert rec["again"]["raised"] == "WeightsDiverged", rec["again"]
    # nothing changed after the refusals; the applied updates are exactly transformers' weights
    assert driver["still_a"] == [t[:8] for t in hf_greedy(dir_a, prompts(3, 5), 8)]
    assert driver["after_b"] == [t[:8] for t in hf_greedy(dir_b, prompts(3, 5), 8)]
    assert driver["after_a"] == driver["still_a"]
    # the request in flight when the weights diverged failed, with the reason
    assert driver["inflight"]["status"] == RequestStatus.FAILED and driver["inflight"]["error"], driver["inflight"]
    assert proc.returncode == 0, proc.stdout[-4000:]
