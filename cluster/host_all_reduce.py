"""The forward's all-reduce through shared memory, for CPU ranks on one host.

A gloo all-reduce costs 2.5 to 3.7 ms here whatever its size (loopback TCP and its threads' wake-ups): a TP=2
decode step of models/small makes 17, about 60 ms of a 400 ms step. Through one shared segment: 0.07 ms for
one row, 0.45 ms for 64 rows of 768 floats.

The segment (a /dev/shm file, unlinked once every rank has mapped it) holds one 64-byte line a rank (its
sequence number, its pid) and two banks of one slot a rank. Call n: each rank copies its tensor into its slot
of bank n % 2, then stores n as its sequence number; it waits until every sequence number is at least n, then
sums the slots in rank order (every rank computes the same floats; `a + b` is gloo's for two ranks). Bank
n % 2 is written again in call n + 2 by a rank past call n + 1's wait: every peer has posted n + 1, which each
does only after reading bank n % 2 in call n, so a bank is never overwritten while read. A tensor larger than
a slot goes in slot-sized pieces. x86-64's memory model orders the copies and stores (stores not reordered
with stores, loads not with loads); other machines keep gloo.

A waiting rank spins briefly, then naps between checks, leaving its core (and the GIL) to other work. It
raises `HostReduceLost` (a DistBackendError, as a broken gloo group would) when a peer's process is gone or
the group's timeout passes. LOCKSTEP_HOST_ALL_REDUCE=0 keeps gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import time
import uuid
from contextlib import suppress

import numpy as np
import torch
import torch.distributed as dist

from cluster.config import HOST_ALL_REDUCE_ENV, HOST_ALL_REDUCE_SLOT_BYTES
from cluster.dist import Groups, agree_all_ok, agree_messages

LINE = 64  # bytes of a rank's line: its sequence number and pid, alone in a cache line
SPINS = 200  # checks before a waiting rank starts to nap between them
NAP_S = 50e-6  # a nap: the core (and the GIL) go to other work, as when ranks outnumber cores
CHECK_S = 0.02  # how often a waiting rank looks for dead peers and the deadline
SHM_DIR = "/dev/shm"


class HostReduceLost(dist.DistBackendError):
    """A peer of the shared-memory all-reduce died or did not arrive within the group's timeout."""


def _pid_alive(pid: int) -> bool:
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


class HostAllReduce:
    def __init__(self, path: str, rank: int, world: int, slot_bytes: int, timeout_s: float | None):
        self.rank, self.world, self.slot_bytes, self.timeout_s = rank, world, slot_bytes, timeout_s
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, self.segment_bytes(world, slot_bytes))
        finally:
            os.close(fd)
        lines = np.frombuffer(self.map, dtype=np.int64, count=world * LINE // 8).reshape(world, LINE // 8)
        self.seqs, self.pids = lines[:, 0], lines[:, 1]
        self.banks = torch.frombuffer(self.map, dtype=torch.uint8, offset=world * LINE,
                                      count=2 * world * slot_bytes).view(2, world, slot_bytes)
        self.seq = 0

    @staticmethod
    def segment_bytes(world: int, slot_bytes: int) -> int:
        return world * LINE + 2 * world * slot_bytes

    @classmethod
    def join(cls, groups: Groups, slot_bytes: int = HOST_ALL_REDUCE_SLOT_BYTES) -> HostAllReduce | None:
        """The host all-reduce of the group, or None (every rank alike) where the ranks must keep gloo: not x86-64,
        disabled, no /dev/shm, or ranks that do not share one segment and pid namespace. Every rank calls it."""
        if not groups.distributed or groups.device.type != "cpu":
            return None
        wanted = platform.machine().lower() in ("x86_64", "amd64") and os.environ.get(HOST_ALL_REDUCE_ENV, "1") != "0"
        if not all(agree_all_ok(wanted, groups)):
            return None
        path = ""
        if groups.is_driver:
            path = os.path.join(SHM_DIR, f"lockstep-allreduce-{uuid.uuid4().hex}")
            try:
                with open(path, "xb") as f:
                    f.truncate(cls.segment_bytes(groups.world_size, slot_bytes))
            except OSError:  # no writable /dev/shm
                path = ""
        path = agree_messages(path, groups)[0]
        reducer, ok = None, bool(path)
        if ok:
            try:
                reducer = cls(path, groups.rank, groups.world_size, slot_bytes, groups.control_timeout)
                reducer.pids[groups.rank] = os.getpid()
            except OSError:
                ok = False
        ok = all(agree_all_ok(ok, groups))  # after it, every rank has written its pid
        if groups.is_driver and path:
            os.unlink(path)  # mapped everywhere (or given up): the name is no longer needed
        if ok:  # one segment and one pid namespace: every rank sees every peer's pid alive
            ok = all(pid > 0 and _pid_alive(int(pid)) for pid in reducer.pids)
            ok = all(agree_all_ok(ok, groups))
        if not ok and reducer is not None:
            reducer.close()
        return reducer if ok else None

    def close(self) -> None:
        """Unmap the segment (the views into it must be gone first)."""
        self.seqs = self.pids = self.banks = None
        with suppress(BufferError):  # a view is still alive somewhere: the mapping goes with the process
            self.map.close()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (x must be a contiguous CPU tensor); returns x. Every rank of the group
        calls it, with tensors of the same shape and dtype, in the same order."""
        flat = x.view(-1)
        step = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), step):
            self._reduce_piece(flat[start:start + step])
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x, [world, *x.shape] in rank order (a copy), or None (on every rank alike: the same shape
        and dtype everywhere) when x does not fit one slot: the caller gathers otherwise. One exchange, no sums, so
        the result is every rank's bits. Every rank of the group calls it, in the same order as `all_reduce`."""
        if x.numel() * x.element_size() > self.slot_bytes:
            return None
        return self._exchange(x.reshape(-1)).clone().view(self.world, *x.shape)

    def _reduce_piece(self, piece: torch.Tensor) -> None:
        slots = self._exchange(piece)
        torch.add(slots[0], slots[1], out=piece)
        for r in range(2, self.world):
            piece.add_(slots[r])

    def _exchange(self, flat: torch.Tensor) -> torch.Tensor:
        """Post `flat` (one slot's worth at most) in this rank's slot of the next call's bank and wait for every
        rank's: that bank's slots [world, n], valid until this rank's call after next."""
        self.seq += 1
        slots = self.banks[self.seq & 1, :, :flat.numel() * flat.element_size()].view(flat.dtype)  # [world, n]
        slots[self.rank].copy_(flat)
        self.seqs[self.rank] = self.seq
        self._wait_all(self.seq)
        return slots

    def _wait_all(self, seq: int) -> None:
        seqs = self.seqs
        for _ in range(SPINS):
            if seqs.min() >= seq:
                return
        start = next_check = time.monotonic()
        while seqs.min() < seq:
            time.sleep(NAP_S)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CHECK_S
                self._check_peers(seq, now - start)

    def _check_peers(self, seq: int, waited_s: float) -> None:
        late = [r for r in range(self.world) if self.seqs[r] < seq]
        dead = [r for r in late if not _pid_alive(int(self.pids[r]))]
        if dead:
            raise HostReduceLost(f"rank {self.rank}: the host all-reduce lost rank(s) {dead} (process gone) "
                                 f"at call {seq}")
        if self.timeout_s is not None and waited_s > self.timeout_s:
            raise HostReduceLost(f"rank {self.rank}: rank(s) {late} did not reach host all-reduce call {seq} "
                                 f"within {self.timeout_s:.0f}s")
