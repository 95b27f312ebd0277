"""The forward's all-reduce through shared memory, for CPU ranks on one host.

A gloo all-reduce costs 2.5 to 3.7 ms here whatever its size (loopback TCP and its threads' wake-ups): a TP=2
decode step of models/small makes 17, about 60 ms of a 400 ms step. Through one shared segment: 0.07 ms for
one row, 0.45 ms for 64 rows of 768 floats.

The segment (cluster/shared_segment.py: one 64-byte line a rank, its sequence number and pid) holds two banks of
one slot a rank. Call n: each rank copies its tensor into its slot
of bank n % 2, then stores n as its sequence number; it waits until every sequence number is at least n, then
sums the slots in rank order (every rank computes the same floats; `a + b` is gloo's for two ranks). Bank
n % 2 is written again in call n + 2 by a rank past call n + 1's wait: every peer has posted n + 1, which each
does only after reading bank n % 2 in call n, so a bank is never overwritten while read. A tensor larger than
a slot goes in slot-sized pieces. Machines other than x86-64 keep gloo.

A waiting rank raises `HostReduceLost` (a DistBackendError, as a broken gloo group would) when a peer's process
is gone or the group's timeout passes. LOCKSTEP_HOST_ALL_REDUCE=0 keeps gloo.
"""

from __future__ import annotations

import os

import torch

from cluster.config import HOST_ALL_REDUCE_ENV, HOST_ALL_REDUCE_SLOT_BYTES
from cluster.dist import Groups, join_shared_segment
from cluster.shared_segment import SharedPeerLost, SharedSegment


class HostReduceLost(SharedPeerLost):
    """A peer of the shared-memory all-reduce died or did not arrive within the group's timeout."""


class HostAllReduce:
    def __init__(self, segment: SharedSegment, slot_bytes: int, timeout_s: float | None):
        self.segment, self.slot_bytes, self.timeout_s = segment, slot_bytes, timeout_s
        self.rank, self.world = segment.rank, segment.world
        self.seqs = segment.counts
        self.banks = torch.frombuffer(segment.map, dtype=torch.uint8, offset=segment.body_offset,
                                      count=2 * self.world * slot_bytes).view(2, self.world, slot_bytes)
        self.seq = 0

    @classmethod
    def join(cls, groups: Groups, slot_bytes: int = HOST_ALL_REDUCE_SLOT_BYTES) -> HostAllReduce | None:
        """The host all-reduce of the group, or None (every rank alike) where the ranks must keep gloo: not CPU
        ranks, not x86-64, disabled, no /dev/shm, or ranks that do not share one segment and pid namespace
        (`join_shared_segment`). Every rank calls it."""
        if not groups.distributed or groups.device.type != "cpu":
            return None
        segment = join_shared_segment(groups, 2 * groups.world_size * slot_bytes, "allreduce",
                                      os.environ.get(HOST_ALL_REDUCE_ENV, "1") != "0")
        return None if segment is None else cls(segment, slot_bytes, groups.control_timeout)

    def close(self) -> None:
        """Unmap the segment (the views into it must be gone first)."""
        self.seqs = self.banks = None
        self.segment.close()

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
        if seqs.min() < seq:
            self.segment.wait(lambda: seqs.min() >= seq, lambda: [r for r in range(self.world) if seqs[r] < seq],
                              f"host all-reduce call {seq}", self.timeout_s, HostReduceLost)
