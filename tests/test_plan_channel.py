"""StepPlans through shared memory for ranks on one host (cluster/plan_channel.py): every plan arrives whole and in
order, a payload longer than a frame and a plan's data still travel over gloo after it, the state rows come back,
the driver may run a ring's worth of plans ahead of a late worker, no segment file is left behind, the environment
switch keeps gloo (the same plans, the same checks), and a dead or silent peer is a typed collective error, not a
hang."""

from __future__ import annotations

import pytest

from tests.conftest import lost_peer_error, read_json, run_ranks


@pytest.mark.slow
@pytest.mark.parametrize("nproc,env", [(2, None), (3, None), (2, {"LOCKSTEP_PLAN_CHANNEL": "0"})],
                         ids=["channel-2", "channel-3", "gloo"])
def test_every_plan_arrives_whole_and_in_order(tmp_path, nproc, env):
    out = tmp_path / "plans.json"
    proc = run_ranks("plan_channel_rank.py", ["plans", str(out)], nproc=nproc, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rec = read_json(out)
    assert rec["made"] is (env is None) and rec["long"] is (env is None)
    assert rec["agree"] and rec["plans"] == 40, rec
    assert rec["left"] == []  # unlinked once every rank mapped it


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["driver_dies", "worker_dies", "stalls"])
def test_a_lost_peer_is_a_collective_error_not_a_hang(tmp_path, mode):
    lost_peer_error("plan_channel_rank.py", mode, tmp_path / f"{mode}.json", "PlanChannelLost", "plan 1")
