"""StepPlans through shared memory for ranks on one host (cluster/plan_channel.py): every plan arrives whole and in
order, a payload longer than a frame and a plan's data still travel over gloo after it, the state rows come back,
the driver may run a ring's worth of plans ahead of a late worker, no segment file is left behind, the environment
switch keeps gloo (the same plans, the same checks), and a dead or silent peer is a typed collective error, not a
hang."""

from __future__ import annotations

import pytest

from tests.conftest import lost_peer_error, read_json, run_ranks


@pytest.mark.slow
@pytest.mark.parametrize("nproc,env", [(2, {"LOCKSTEP_PLAN_CHANNEL": "1"}), (3, {"LOCKSTEP_PLAN_CHANNEL": "1"}),
                                      (2, None)], ids=["channel-2", "channel-3", "gloo"])
def test_every_plan_arrives_whole_and_in_order(tmp_path, nproc, env):
    out = tmp_path / "plans.json"
    proc = run_ranks("plan_channel_rank.py", ["plans", str(out)], nproc=nproc, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rec = read_json(out)
    assert rec["made"] is (env is not None) and rec["long"] is (env is not None)  # the channel is opt-in
    assert rec["agree"] and rec["plans"] == 40, rec
    assert rec["left"] == []  # unlinked once every rank mapped it


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["driver_dies", "worker_dies", "stalls"])
def test_a_lost_peer_is_a_collective_error_not_a_hang(tmp_path, mode):
    lost_peer_error("plan_channel_rank.py", mode, tmp_path / f"{mode}.json", "PlanChannelLost", "plan 1",
                    env={"LOCKSTEP_PLAN_CHANNEL": "1"})


def test_the_ring_in_one_process(tmp_path):
    """The driver's and a worker's ends of one small segment, mapped twice in this process: frames of every length
    come out in order, the driver runs at most a ring's worth ahead (then its wait times out: the worker is alive),
    the worker's state row reaches the driver, and a worker whose process is gone fails the driver's next post."""
    import os

    import numpy as np

    from cluster.plan_channel import SLOTS, PlanChannel, PlanChannelLost
    from cluster.shared_segment import SharedSegment

    slot, body = 4096, PlanChannel.body_bytes(4096)
    path = tmp_path / "segment"
    with open(path, "wb") as f:
        f.truncate(SharedSegment.size(2, body))
    driver, worker = (PlanChannel(SharedSegment(str(path), r, 2, body), slot) for r in (0, 1))
    driver.segment.pids[:] = os.getpid()
    frames = [np.arange(n, dtype=np.int64) * (n + 1) for n in (1, 7, slot // 8 - 1, 0, 300, 2, 5, 9, 11, 13)]
    for i, frame in enumerate(frames):
        driver.post(frame, timeout_s=1)
        if i % 3 == 2:  # the worker falls behind, then catches up
            continue
        while worker.seq < driver.seq:
            got = worker.take(np.array([7, worker.seq + 1, 9]), timeout_s=1)
            assert np.array_equal(got, frames[worker.seq - 1])
    assert list(driver.states(20, timeout_s=1)[1, :4]) == [7, len(frames), 9, 0]
    for frame in frames[:SLOTS]:  # a full ring: the next post waits for a take that does not come
        driver.post(frame, timeout_s=1)
    with pytest.raises(PlanChannelLost, match="did not reach"):
        driver.post(frames[0], timeout_s=0.1)
    with open("/proc/sys/kernel/pid_max") as f:
        driver.segment.pids[1] = int(f.read()) + 1  # no process has it
    driver.next_check = 0.0
    with pytest.raises(PlanChannelLost, match=r"lost rank\(s\) \[1\] \(process gone\)"):
        driver.post(frames[0], timeout_s=1)
