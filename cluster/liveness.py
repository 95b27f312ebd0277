"""Who is still alive: each rank stamps (step, time, pid, process start, host) into the group's store from a small
thread, so that when a collective fails the driver can name the rank that died (a broken gloo group cannot say which
peer it lost), and kill one that hangs (`condemn`): a stopped process does not die of the launcher's SIGTERM, and
torchrun waits 30 s before its SIGKILL (docs/recovery.md). The same thread watches its peers' stamps
(`watch_peers`): a peer on this host whose stamp has not moved for half the control group's timeout is hung and is
killed there and then, so the group fails as it does for a dead rank, before any collective's timeout."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from contextlib import suppress

import torch.distributed as dist

from cluster.dist import Groups

PERIOD_S = 0.5
HANG_SHARE = 0.5  # a peer's stamp still for this share of the control group's timeout: the peer is hung
log = logging.getLogger("lockstep")


def process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc's field 22): with the pid, names one process."""
    return process_stat(pid)[1]


def process_stat(pid: int) -> tuple[str, str]:
    """(state, start time) of the process (/proc's fields 3 and 22): `Z` or `X` when it has already ended."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], fields[19]


def host_key() -> str:
    """Where a pid means the same process: this boot of this machine and this pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # no /proc: no pid is taken as local
        return f"unknown-{os.getpid()}-{id(PERIOD_S)}"


def hang_after_s(control_timeout: float | None, period_s: float = PERIOD_S) -> float | None:
    """How long a peer's stamp may stand still before the watch calls it hung: half the control group's timeout (so a
    hung rank is named and killed before any collective waiting for it times out), at least three periods; None
    (no watch) for a group without a timeout."""
    return None if control_timeout is None else max(3 * period_s, HANG_SHARE * control_timeout)


class Liveness:
    def __init__(self, groups: Groups, period_s: float = PERIOD_S):
        self.groups, self.period_s, self.step = groups, period_s, 0
        self.last_seen: dict[int, tuple[int, float, str]] = {}  # the stamps `silent_ranks` last read
        self.hang_after_s = hang_after_s(groups.control_timeout, period_s)
        # rank -> (its stamp as this rank last read it, time.monotonic() when that stamp was first read here)
        self.moved: dict[int, tuple[tuple[int, float, str], float]] = {}
        self.stop_event = threading.Event()
        self.store = dist.distributed_c10d._get_default_store() if groups.distributed else None
        self.thread = threading.Thread(target=self._run, name="lockstep-liveness", daemon=True)
        self.host = host_key()
        try:
            self.me = f"{os.getpid()} {process_start(os.getpid())} {self.host}"
        except (OSError, IndexError):
            self.me = f"{os.getpid()} ? {self.host}"
        self.state = "up"  # "down": this rank's loop failed and it leaves on its own (`mark_down`)

    def start(self) -> "Liveness":
        if self.store is not None:
            self._stamp()
            self.thread.start()
            atexit.register(self.stop)  # runs before the groups' own teardown (registered earlier)
        return self

    def stop(self) -> None:
        """Stop stamping and wait for the thread, so no store call is in flight when the process exits. A last stamp
        says this rank stopped on purpose, so its peers' watch does not take its silence for a hang."""
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(4 * self.period_s)
        if self.store is not None and self.state == "up":
            self.state = "stopped"
            with suppress(Exception):
                self._stamp()

    def _stamp(self) -> None:
        self.store.set(f"lockstep/alive/{self.groups.rank}", f"{self.step} {time.time()} {self.state} {self.me}")

    def mark_down(self) -> None:
        """Stop stamping, with a last stamp saying this rank leaves on its own: the driver still names it (the stamp
        stops moving) but `condemn` does not kill it."""
        self.stop()
        if self.store is not None:
            self.state = "down"
            with suppress(Exception):
                self._stamp()

    def _run(self) -> None:
        watch_failed = False
        while not self.stop_event.wait(self.period_s):
            try:
                self._stamp()
            except Exception:  # the store went away: the group is ending
                return
            try:
                self.watch_peers()
            except Exception:  # a failed look at the peers must never stop this rank's own stamps
                if not watch_failed:
                    log.exception("lockstep: the liveness watch failed (this rank goes on stamping)")
                watch_failed = True

    def watch_peers(self) -> list[int]:
        """Kill every peer on this host whose stamp says `up` but has not moved for `hang_after_s` on this rank's
        clock (a stopped or stuck process): the launcher then restarts the group as for a dead rank, and the
        collectives waiting for it fail at once (a dead pid, a closed socket) instead of at their timeout. Every
        rank's stamping thread calls it each period; not a collective. Returns the ranks killed."""
        if self.hang_after_s is None:
            return []
        now, hung = time.monotonic(), []
        for rank, stamp in self._stamps().items():
            if rank == self.groups.rank:
                continue
            seen = self.moved.get(rank)
            if seen is None or seen[0] != stamp:
                self.moved[rank] = (stamp, now)
            elif now - seen[1] >= self.hang_after_s and stamp[2].startswith("up "):
                hung.append((rank, stamp[0], now - seen[1]))
        if not hung:
            return []
        killed = self.condemn(hung, {r: seen[0] for r, seen in self.moved.items()})
        for rank in killed:
            log.error("lockstep: rank %d's liveness stamp stood still for %.1fs (cpu_group_timeout %gs): it hangs; "
                      "killed it before any collective's timeout", rank, now - self.moved[rank][1],
                      self.groups.control_timeout)
            self.moved.pop(rank, None)
        return killed

    def _stamps(self) -> dict[int, tuple[int, float, str]]:
        """rank -> (step, time, "state pid start host") as each rank last stamped them."""
        out = {}
        for rank in range(self.groups.world_size):
            key = f"lockstep/alive/{rank}"
            with suppress(Exception):
                if self.store.check([key]):
                    step, stamp, who = self.store.get(key).decode().split(" ", 2)
                    out[rank] = (int(step), float(stamp), who)
        return out

    def silent_ranks(self) -> list[tuple[int, int, float]]:
        """(rank, last step it reported, seconds since) for every other rank whose stamp stops moving: watched
        for three periods, so a rank that died a moment ago is caught as surely as one long gone. A stamp already
        older than three periods (a rank hung through a collective's timeout) is silent without the wait."""
        first = self._stamps()
        self.last_seen = first
        deadline = time.time() + 3 * self.period_s
        others = {r for r in range(self.groups.world_size) if r != self.groups.rank}
        stale = {r for r in others if r not in first  # the age only on this host's clock:
                 or (first[r][2].endswith(self.host) and first[r][1] < time.time() - 3 * self.period_s)}
        watched = others - stale
        while watched and time.time() < deadline:
            time.sleep(self.period_s / 2)
            now = self._stamps()
            watched = {r for r in watched if now.get(r) == first.get(r)}
        now_t = time.time()
        return [(r, first.get(r, (-1, 0.0))[0], now_t - first.get(r, (-1, 0.0))[1])
                for r in sorted(stale | watched)]

    def condemn(self, silent: list[tuple[int, int, float]],
                stamps: dict[int, tuple[int, float, str]] | None = None) -> list[int]:
        """SIGKILL the process of every silent rank (from `silent_ranks`) that runs on this host, so the launcher
        sees it dead and restarts the group now: a hung or stopped rank would not die of the launcher's SIGTERM.
        Only the process that stamped is killed (pid and start time must both match). Not a collective: any rank
        that named the silent ones calls it. `stamps`: the stamps they were named by (default: those `silent_ranks`
        last read). Returns the ranks killed."""
        stamps = self.last_seen if stamps is None else stamps
        killed = []
        for rank, *_ in silent:
            state, pid, start, host = stamps.get(rank, (0, 0.0, "down 0 ? ?"))[2].split(" ", 3)
            if state != "up" or host != self.host or pid == str(os.getpid()):
                continue  # it leaves on its own; or another machine's pid: its launcher's SIGTERM (SIGKILL at 30 s)
            try:
                now_state, now_start = process_stat(int(pid))
                if now_start != start or now_state in ("Z", "X"):
                    continue  # that process is gone (its launcher has yet to reap it); or the pid names another one
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, IndexError):
                continue  # it ended on its own meanwhile
            log.error("lockstep: rank %d (pid %s) stopped answering: killed it (SIGKILL)", rank, pid)
            killed.append(rank)
        return killed

    def describe(self, silent: list[tuple[int, int, float]], step: int, error: BaseException,
                 killed: list[int] = ()) -> str:
        """One sentence naming the silent rank(s) (from `silent_ranks`; `killed`: those `condemn` killed), for
        every request's error."""
        who = "; ".join(f"rank {r} stopped answering at step {s} ({age:.1f}s silent"
                        + (", killed)" if r in killed else ")") for r, s, age in silent)
        return f"{who}; the driver was at step {step}: {type(error).__name__}: {str(error)[:200]}"
