"""The liveness watch (cluster/liveness.py `Liveness.watch_peers`, issue 37 item 2): a peer on this host whose stamp
stands still for half of cpu_group_timeout is SIGKILLed; one whose stamp moves, or that stamped `stopped` or `down`
(it leaves on its own), is left alone. A real process stands in for the peer; stamps go through a HashStore."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from cluster.dist import Groups
from cluster.liveness import Liveness, hang_after_s, process_start

PERIOD_S = 0.1
TIMEOUT_S = 1.0  # hang_after_s: 0.5 s


@pytest.fixture
def peer() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait(10)


def watcher(monkeypatch, control_timeout: float | None = TIMEOUT_S) -> Liveness:
    """Rank 0 of a two-rank group whose store is a HashStore."""
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: dist.HashStore())
    groups = Groups(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), control_timeout=control_timeout)
    return Liveness(groups, period_s=PERIOD_S)


def stamp(liveness: Liveness, step: int, state: str, pid: int) -> None:
    """Rank 1's stamp as its own thread would write it (a running process on this host)."""
    liveness.store.set("lockstep/alive/1", f"{step} {time.time()} {state} {pid} {process_start(pid)} {liveness.host}")


def watch(liveness: Liveness, proc: subprocess.Popen, seconds: float, moving: bool = False) -> float | None:
    """Call watch_peers each period for `seconds` (restamping rank 1 each time when `moving`); the seconds until
    the peer died, or None if it lived through."""
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < seconds:
        if moving:
            step += 1
            stamp(liveness, step, "up", proc.pid)
        liveness.watch_peers()
        if proc.poll() is not None:
            return time.monotonic() - start
        time.sleep(PERIOD_S)
    return None


@pytest.mark.slow
def test_a_peer_whose_stamp_stands_still_is_killed_after_half_the_timeout(monkeypatch, peer):
    liveness = watcher(monkeypatch)
    stamp(liveness, 7, "up", peer.pid)
    died = watch(liveness, peer, 4 * TIMEOUT_S)
    assert died is not None and hang_after_s(TIMEOUT_S, PERIOD_S) <= died < TIMEOUT_S, died
    assert peer.wait(5) == -9  # SIGKILL: a stopped process dies of it too


@pytest.mark.slow
@pytest.mark.parametrize("state", ["stopped", "down"])
def test_a_peer_that_leaves_on_its_own_is_not_killed(monkeypatch, peer, state):
    liveness = watcher(monkeypatch)
    stamp(liveness, 7, state, peer.pid)
    assert watch(liveness, peer, 3 * TIMEOUT_S) is None


@pytest.mark.slow
def test_a_peer_whose_stamp_moves_is_not_killed(monkeypatch, peer):
    assert watch(watcher(monkeypatch), peer, 3 * TIMEOUT_S, moving=True) is None


@pytest.mark.slow
def test_no_watch_without_a_timeout(monkeypatch, peer):
    liveness = watcher(monkeypatch, control_timeout=None)
    stamp(liveness, 7, "up", peer.pid)
    assert liveness.hang_after_s is None and watch(liveness, peer, 3 * TIMEOUT_S) is None


def test_a_failing_watch_does_not_stop_this_ranks_stamps(monkeypatch):
    """A frozen stamp would get this (healthy) rank killed by its peers' watch."""
    liveness = watcher(monkeypatch)

    def broken() -> list[int]:
        raise ValueError("a malformed stamp")

    liveness.watch_peers = broken
    liveness.start()
    try:
        first = liveness.store.get("lockstep/alive/0")
        deadline = time.monotonic() + 20 * PERIOD_S
        stamps = {first}
        while len(stamps) < 4 and time.monotonic() < deadline:
            time.sleep(PERIOD_S / 2)
            stamps.add(liveness.store.get("lockstep/alive/0"))
        assert len(stamps) >= 4 and liveness.thread.is_alive(), stamps
    finally:
        liveness.stop()
    assert liveness.store.get("lockstep/alive/0").decode().split()[2] == "stopped"
