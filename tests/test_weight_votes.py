"""Weight updates stay all-or-none and fail loudly at TP=2 (real processes, injected faults on rank 1):
a refusal raises WeightUpdateError on every rank (the front door's path gets a dict naming the rank), an
exception with an empty message votes against, a rank holding another weight version votes against naming
both numbers, versions move on every rank, and a rank that fails while copying makes every rank raise
WeightsDiverged and ends the loop."""

from __future__ import annotations

import pytest

from cluster.outputs import RequestStatus
from tests.conftest import hf_greedy, read_json, run_ranks
from tests.scripts.update_faults_rank import FAULTS
from tests.scripts.update_rank import prompts


@pytest.fixture(scope="module")
def run(make_checkpoint, tmp_path_factory):
    """One TP=2 run of the script under FAULTS; (records of rank 0 and 1, checkpoint A, B, torchrun's result)."""
    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    out = tmp_path_factory.mktemp("weight_votes") / "rec"
    proc = run_ranks("update_faults_rank.py", [str(dir_a), str(dir_b), str(out)], timeout=240,
                     env={"LOCKSTEP_FAULTS": FAULTS})
    return [read_json(f"{out}.rank{r}") for r in range(2)], dir_a, dir_b, proc


def refused_by_rank_1(r: dict, text: str) -> None:
    assert r["raised"] == "WeightUpdateError" and r["code"] == "weight_update_failed", r
    assert r["rank"] == 1 and f"rank 1: {text}" in r["message"], r


@pytest.mark.slow
def test_empty_message_votes_against(run):
    """A tensor whose values raise ValueError() (no message) on rank 1: refused on every rank, not "ok"."""
    for rec in run[0]:
        refused_by_rank_1(rec["no_message"], "ValueError (no message)")


@pytest.mark.slow
def test_front_door_gets_a_refused_dict_naming_the_rank(run):
    r = run[0][0]["async"]
    assert r["ok"] is False and r["rank"] == 1 and "rank 1: InjectedFault" in r["error"], r


@pytest.mark.slow
def test_refusal_raises_the_same_error_on_every_rank(run):
    recs = run[0]
    for rec in recs:
        refused_by_rank_1(rec["refused"], "InjectedFault")
        refused_by_rank_1(rec["silent"], "ValueError (no message)")
    assert recs[0]["refused"]["message"] == recs[1]["refused"]["message"]


@pytest.mark.slow
def test_a_rank_holding_another_version_votes_against(run):
    for rec in run[0]:
        refused_by_rank_1(rec["version"], "this rank holds weight version 7, the plan carries 0")


@pytest.mark.slow
def test_versions_move_on_every_rank_and_refusals_change_nothing(run):
    recs, dir_a, dir_b, _ = run
    for rec in recs:
        assert rec["applied"]["raised"] is None and rec["applied"]["result"]["version"] == 1, rec["applied"]
        assert rec["version_after_applied"] == 1
        assert rec["paused"]["raised"] is None and rec["paused"]["result"]["version"] == 7, rec["paused"]
        assert rec["version_after_paused"] == 7
    assert recs[0]["still_a"] == [t[:8] for t in hf_greedy(dir_a, prompts(3, 5), 8)]
    assert recs[0]["after_b"] == [t[:8] for t in hf_greedy(dir_b, prompts(3, 5), 8)]
    assert recs[0]["after_a"] == recs[0]["still_a"]


@pytest.mark.slow
def test_an_update_right_after_a_pause_runs_through_the_loop(run):
    for rec in run[0]:
        assert [r["raised"] for r in rec["after_pause"]] == [None] * 5, rec["after_pause"]
        assert [r["result"]["version"] for r in rec["after_pause"]] == [2, 3, 4, 5, 6]


@pytest.mark.slow
def test_copy_failure_raises_weights_diverged_everywhere_and_ends_the_loop(run):
    recs, proc = run[0], run[3]
    for rec in recs:
        d = rec["diverged"]
        assert d["raised"] == "WeightsDiverged" and d["code"] == "weights_diverged", d
        assert "rank 1: InjectedFault" in d["message"] and "rank 0" not in d["message"], d
        assert rec["loop_running_after"] is False
        assert rec["again"]["raised"] == "WeightsDiverged", rec["again"]
    # the request in flight when the weights diverged failed, with a reason
    assert recs[0]["inflight"]["status"] == RequestStatus.FAILED and recs[0]["inflight"]["error"], recs[0]
    assert proc.returncode == 0, proc.stdout[-4000:]


def test_copy_failure_inside_a_pause_ends_the_loop_tp1(make_checkpoint, monkeypatch):
    """Inside a pause the caller runs the update itself: a copy failure raises WeightsDiverged to it, the loop
    ends once the pause is left (it must not serve on), and every later update raises it again."""
    import cluster
    from cluster import faults
    from worker.weights import WeightsDiverged

    monkeypatch.setattr(faults, "RULES", faults._parse("apply_weights:rank=0"))
    model = cluster.load(make_checkpoint("llama"))
    m = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(page_size=16))
    m.start()
    try:
        with m.pause():
            with pytest.raises(WeightsDiverged, match="rank 0: InjectedFault"):
                m.update_weights(make_checkpoint("llama", seed=1))
        m.join(timeout=10)
        assert not m.is_running()
        with pytest.raises(WeightsDiverged):
            m.update_weights(make_checkpoint("llama"))
    finally:
        m.stop(timeout=10)
        m.destroy()
