"""A shared-memory segment that every rank of a group on one host maps: what the host all-reduce
(cluster/host_all_reduce.py) and the plan channel (cluster/plan_channel.py) are built on.

The segment (a /dev/shm file, unlinked once every rank has mapped it; `cluster.dist.join_shared_segment` agrees on
it) holds one 64-byte line a rank, its counter and its pid alone in a cache line, then a body each user lays out.
A rank posts by writing the body, then storing its counter; a peer that sees the counter then reads the body.
x86-64's memory model orders those stores and loads (stores not reordered with stores, loads not with loads);
other machines keep gloo.

A waiting rank spins briefly, then naps between checks, leaving its core (and the GIL) to other work. It raises
`SharedPeerLost` (a DistBackendError, as a broken gloo group would) when a peer's process is gone or the
group's timeout passes.
"""

from __future__ import annotations

import mmap
import os
import time
from contextlib import suppress
from typing import Callable

import numpy as np
import torch.distributed as dist

LINE = 64  # bytes of a rank's line: its counter and pid, alone in a cache line
SPINS = 200  # checks before a waiting rank starts to nap between them
NAP_S = 50e-6  # a nap: the core (and the GIL) go to other work, as when ranks outnumber cores
IDLE_NAP_S = 1e-3  # a nap once a wait has lasted IDLE_AFTER_S (an idle worker's wait for the next plan)
IDLE_AFTER_S = 0.02
CHECK_S = 0.02  # how often a waiting rank looks for dead peers and the deadline
SHM_DIR = "/dev/shm"


class SharedPeerLost(dist.DistBackendError):
    """A peer of a shared-memory exchange died or did not arrive within the group's timeout."""


def pid_alive(pid: int) -> bool:
    """Whether the process runs: a killed one that its launcher has not reaped yet (a zombie, which still answers
    kill(pid, 0)) is gone, so a waiting rank sees a SIGKILLed peer within CHECK_S, as gloo's closed sockets show it,
    not only after torchrun's next poll (which also SIGTERMs the survivors)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # the state, after the command's name
    except (OSError, IndexError):  # no /proc (not Linux): kill(pid, 0) said it runs
        return True


class SharedSegment:
    """One rank's mapping of the segment at `path`: `lines` [world, 8] int64, whose first two columns are `counts`
    and `pids`, and the body from byte `body_offset` of `map`."""

    def __init__(self, path: str, rank: int, world: int, body_bytes: int):
        self.rank, self.world = rank, world
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, self.size(world, body_bytes))
        finally:
            os.close(fd)
        self.lines = np.frombuffer(self.map, dtype=np.int64, count=world * LINE // 8).reshape(world, LINE // 8)
        self.counts, self.pids = self.lines[:, 0], self.lines[:, 1]  # the rest of a line: the user's
        self.body_offset = world * LINE

    @staticmethod
    def size(world: int, body_bytes: int) -> int:
        return world * LINE + body_bytes

    def close(self) -> None:
        """Unmap the segment (the users' views into it must be gone first)."""
        self.lines = self.counts = self.pids = None
        with suppress(BufferError):  # a view is still alive somewhere: the mapping goes with the process
            self.map.close()

    def wait(self, ready: Callable[[], bool], late: Callable[[], list[int]], what: str,
             timeout_s: float | None, error: type[SharedPeerLost], idle: bool = False) -> None:
        """Return once `ready()`; raise `error` when a rank of `late()` (those it waits for) is gone, or after
        `timeout_s`. `idle`: a wait that may last (a worker's for its next plan) naps IDLE_NAP_S after IDLE_AFTER_S,
        so an idle rank wakes a thousand times a second, not twenty thousand."""
        for _ in range(SPINS):
            if ready():
                return
        start = next_check = time.monotonic()
        while not ready():
            now = time.monotonic()
            time.sleep(IDLE_NAP_S if idle and now - start > IDLE_AFTER_S else NAP_S)
            if now >= next_check:
                next_check = now + CHECK_S
                self.check(late(), what, error, now - start, timeout_s)

    def check(self, ranks: list[int], what: str, error: type[SharedPeerLost], waited_s: float = 0.0,
              timeout_s: float | None = None) -> None:
        """Raise `error` when a rank of `ranks` is gone, or when `waited_s` is past `timeout_s`."""
        dead = [r for r in ranks if not pid_alive(int(self.pids[r]))]
        if dead:
            raise error(f"rank {self.rank}: {what} lost rank(s) {dead} (process gone)")
        if timeout_s is not None and waited_s > timeout_s:
            raise error(f"rank {self.rank}: rank(s) {ranks} did not reach {what} within {timeout_s:.0f}s")
