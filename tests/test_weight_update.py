"""Hot weight updates: under load at TP=2 no request is lost, requests after the update match transformers
on the new checkpoint, recomputed in-flight requests match transformers' continuation, per-token versions are
right, and a bad update (on any rank) changes nothing."""

from __future__ import annotations

import pytest
from cluster.outputs import RequestStatus
from tests.conftest import hf_greedy, read_json, run_ranks
from tests.scripts.update_rank import N_INFLIGHT, prompts


def hf_continue(model_dir, prompt, emitted, n):
    """transformers' greedy tokens for prompt + already emitted tokens."""
    return hf_greedy(model_dir, [prompt + emitted], n)[0]


def check(rec: dict, dir_a, dir_b, world: int) -> None:
    assert rec["recompute"]["ok"] and rec["recompute"]["version"] == 1
    assert rec["keep"]["ok"] and rec["keep"]["version"] == 2
    # every in-flight request completed, none dropped or duplicated
    for key in ("inflight_recompute", "inflight_keep"):
        outs = rec[key]
        assert len(outs) == N_INFLIGHT and len({o["id"] for o in outs}) == N_INFLIGHT
        assert all(o["status"] == RequestStatus.FINISHED and len(o["tokens"]) == 24 for o in outs)
    # after the update: exactly transformers on B
    assert [o["tokens"] for o in rec["after_b"]] == [t[:16] for t in hf_greedy(dir_b, prompts(4, 2), 16)]
    # recompute: the tokens after the switch are transformers(B) continuing prompt + what A had emitted
    switched = 0
    for o in rec["inflight_recompute"]:
        versions = o["versions"]
        assert versions[0] == [0, 0] or versions == [[0, 1]]
        cut = versions[1][0] if len(versions) == 2 else 0
        assert [v for _, v in versions] in ([0, 1], [1])
        if cut < 24:
            want = hf_continue(dir_b, o["prompt"], o["tokens"][:cut], 24 - cut)
            assert o["tokens"][cut:] == want, (o["id"], cut)
            switched += cut > 0
    assert switched > 0, "no request was caught mid-generation"
    # keep: versions move from 1 to 2 inside requests, in order
    assert any(len(o["versions"]) == 2 for o in rec["inflight_keep"])
    for o in rec["inflight_keep"]:
        assert [v for _, v in o["versions"]] in ([1], [1, 2], [2])
    # bad updates: refused loudly (WeightUpdateError naming the first refusing rank), and nothing changed
    for key, first in (("missing", 0), ("truncated", 0), ("wrong_shape", world - 1)):
        assert rec[key]["raised"] == "WeightUpdateError" and rec[key]["code"] == "weight_update_failed", rec[key]
        assert rec[key]["rank"] == first, rec[key]
    assert not rec["missing"]["ok"] and "no checkpoint directory" in rec["missing"]["error"]
    assert all(f"rank {r}:" in rec["missing"]["error"] for r in range(world))
    assert not rec["truncated"]["ok"] and "rank 0:" in rec["truncated"]["error"]
    bad_rank = world - 1
    assert not rec["wrong_shape"]["ok"]
    assert f"rank {bad_rank}: tensors: tensor model.layers.1.mlp.down_proj.weight: shape" in rec["wrong_shape"]["error"]
    assert rec["missing"]["version"] == rec["wrong_shape"]["version"] == 2
    assert [o["tokens"] for o in rec["still_a"]] == [t[:16] for t in hf_greedy(dir_a, prompts(4, 4), 16)]
    assert rec["stats"]["weight_version"] == 2


@pytest.mark.slow
def test_updates_tp1(make_checkpoint, tmp_path):
    from tests.scripts.update_rank import run

    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    check(run(str(dir_a), str(dir_b), str(tmp_path)), dir_a, dir_b, 1)


@pytest.mark.slow
def test_updates_tp2_under_load(make_checkpoint, tmp_path):
    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    proc = run_ranks("update_rank.py", [str(dir_a), str(dir_b), str(tmp_path)], timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:]
    check(read_json(tmp_path / "update.rank0.json"), dir_a, dir_b, 2)
    worker = read_json(tmp_path / "update.rank1.json")  # the worker's caller raises the very same error
    for key in ("missing", "truncated", "wrong_shape"):
        assert worker[key]["raised"] == "WeightUpdateError", worker[key]
        assert worker[key]["error"] == read_json(tmp_path / "update.rank0.json")[key]["error"]
