"""The forward's shared-memory all-reduce for CPU ranks on one host (cluster/host_all_reduce.py): the same sums
as gloo bit for bit, in pieces when a tensor is larger than a slot, no segment file left behind, the environment
switch, and a typed collective error (not a hang) when a peer dies or stalls; the engine at TP=2 uses it."""

from __future__ import annotations

import pytest

from tests.conftest import lost_peer_error, read_json, run_ranks


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_sums_equal_gloo_and_leave_no_segment(tmp_path, nproc):
    out = tmp_path / "sums.json"
    proc = run_ranks("host_all_reduce_rank.py", ["sums", str(out)], nproc=nproc, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rec = read_json(out)
    assert rec["made"] and rec["agree"] and rec["count"] == 15  # every rank holds the same bits
    # two ranks: a + b, exactly gloo's; more: the same sum in rank order, within rounding of gloo's ring order
    assert rec["same"] if nproc == 2 else rec["close"]
    assert rec["left"] == []  # unlinked once every rank mapped it
    assert rec["gathered"] == [[r + 0.5] * 3 for r in range(nproc)] and rec["too_big"]  # `all_gather`


@pytest.mark.slow
def test_the_environment_keeps_gloo(tmp_path):
    out = tmp_path / "off.json"
    proc = run_ranks("host_all_reduce_rank.py", ["sums", str(out)], env={"LOCKSTEP_HOST_ALL_REDUCE": "0"},
                     timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert read_json(out)["made"] is False


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dies", "stalls"])
def test_a_lost_peer_is_a_collective_error_not_a_hang(tmp_path, mode):
    lost_peer_error("host_all_reduce_rank.py", mode, tmp_path / f"{mode}.json", "HostReduceLost",
                    "host all-reduce call 1")


@pytest.mark.slow
def test_a_killed_peer_not_yet_reaped_counts_as_gone():
    """A SIGKILLed rank stays a zombie until its launcher reaps it, and a zombie still answers kill(pid, 0): the
    waiting ranks must see it gone at once (as gloo's broken sockets do), not after the launcher's poll, which
    also SIGTERMs the survivors and so races the driver's failing of every request."""
    import os
    import signal
    import subprocess
    import time

    from cluster.shared_segment import pid_alive

    child = subprocess.Popen(["sleep", "60"])
    try:
        assert pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # dead, not reaped: poll() is never called until the end
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        assert not pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()
