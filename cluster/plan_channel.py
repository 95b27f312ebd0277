"""StepPlan frames through shared memory, for ranks on one host (docs/architecture.md, "The StepPlan").

A gloo broadcast of a plan's frame costs the driver 0.1 ms on an idle machine and 0.35-0.5 ms beside busy ranks
(gloo's worker thread, loopback TCP, the peers' wake-ups): a third of the driver's host time a step at 256
sequences (benchmarks/control_plane.py). Through this channel: a copy and a store.

The segment (cluster/shared_segment.py) holds SLOTS slots of PLAN_CHANNEL_SLOT_BYTES, each a frame's length in
int64 words, then the frame. The driver's counter is the frames it has posted, a worker's the frames it has
taken. Frame n goes in slot n % SLOTS once every worker has taken frame n - SLOTS (the driver is at most SLOTS
plans ahead of the slowest worker, as gloo's socket buffers let it be), then the driver stores n; a worker waits
for n, copies the frame out, writes its state row (cluster/plan.py `S`) in the rest of its line and stores n. A
plan that gathers the state rows reads them once every worker has taken it. A frame carries the payload inline
when it fits (`room` words); a longer payload, and a plan's data, follow over gloo, as without the channel.

The driver checks its workers' processes every CHECK_S as it posts, so a dead worker fails the next plan as
gloo's broken socket would; a worker waiting for a plan raises when the driver's process is gone or the control
timeout passes (the driver sends a plan at least every IDLE_HEARTBEAT_S). The plan after an IDLE heartbeat goes
over gloo (`cluster.dist.live_channel`): an idle worker blocks there instead of waking a thousand times a second
(3.5 % of a core against 0.8 %, a TP=2 server idle for 10 s), and the first work after it pays one broadcast.
Opt-in, LOCKSTEP_PLAN_CHANNEL=1, until the control timeout it once met in a full test run is explained
(docs/architecture.md, "The StepPlan").
"""

from __future__ import annotations

import time

import numpy as np

from cluster.plan import HEADER_LEN
from cluster.shared_segment import CHECK_S, SharedPeerLost, SharedSegment

SLOTS = 4
STATE_WORDS = 6  # a worker's state row rides in its line, after its counter and pid
PLAN_CHANNEL_SLOT_BYTES = 1 << 20  # a slot: a frame's length and the frame (a longer payload follows over gloo)
DRIVER = 0


class PlanChannelLost(SharedPeerLost):
    """The driver (or, seen from the driver, a worker) of the plan channel died or went silent past the timeout."""


class PlanChannel:
    def __init__(self, segment: SharedSegment, slot_bytes: int = PLAN_CHANNEL_SLOT_BYTES):
        self.segment, self.rank, self.world = segment, segment.rank, segment.world
        words = slot_bytes // 8
        self.slots = np.frombuffer(segment.map, dtype=np.int64, offset=segment.body_offset,
                                   count=SLOTS * words).reshape(SLOTS, words)
        self.room = 2 * (words - 1 - HEADER_LEN)  # int32 payload words a frame carries inline
        self.seq = 0  # frames this rank posted (the driver) or took (a worker)
        self.after_idle = False  # the last plan was an IDLE heartbeat: the next goes over gloo (cluster/dist.py)
        self.next_check = 0.0

    @staticmethod
    def body_bytes(slot_bytes: int = PLAN_CHANNEL_SLOT_BYTES) -> int:
        return SLOTS * slot_bytes

    def close(self) -> None:
        self.slots = None
        self.segment.close()

    def post(self, frame: np.ndarray, timeout_s: float | None) -> None:
        """The driver: hand `frame` (int64, at most a slot) to every worker."""
        seq, counts = self.seq + 1, self.segment.counts
        workers = range(1, self.world)
        if counts[1:].min() < seq - SLOTS:  # the slot still holds a frame some worker has not taken
            self.segment.wait(lambda: counts[1:].min() >= seq - SLOTS,
                              lambda: [r for r in workers if counts[r] < seq - SLOTS], f"plan {seq}'s slot",
                              timeout_s, PlanChannelLost)
        now = time.monotonic()
        if now >= self.next_check:  # a dead worker fails this plan, as gloo's broken socket would
            self.next_check = now + CHECK_S
            self.segment.check(list(workers), f"plan {seq}", PlanChannelLost)
        slot = self.slots[seq % SLOTS]
        slot[0] = frame.size
        slot[1:1 + frame.size] = frame
        counts[DRIVER] = seq
        self.seq = seq

    def states(self, width: int, timeout_s: float | None) -> np.ndarray:
        """The driver, after posting a plan that gathers them: [world, width] int64, every worker's state row as
        it took that plan (the driver's row zeros)."""
        seq, counts = self.seq, self.segment.counts
        if counts[1:].min() < seq:
            self.segment.wait(lambda: counts[1:].min() >= seq, lambda: [r for r in range(1, self.world)
                                                                       if counts[r] < seq],
                              f"plan {seq}'s state rows", timeout_s, PlanChannelLost)
        rows = np.zeros((self.world, width), np.int64)
        rows[1:, :STATE_WORDS] = self.segment.lines[1:, 2:2 + STATE_WORDS]
        return rows

    def take(self, state: np.ndarray, timeout_s: float | None) -> np.ndarray:
        """A worker: the driver's next frame (a copy), leaving this rank's `state` row (at most STATE_WORDS) for
        the driver."""
        seq, counts = self.seq + 1, self.segment.counts
        if counts[DRIVER] < seq:
            self.segment.wait(lambda: counts[DRIVER] >= seq, lambda: [DRIVER], f"plan {seq}", timeout_s,
                              PlanChannelLost, idle=True)
        slot = self.slots[seq % SLOTS]
        frame = slot[1:1 + int(slot[0])].copy()
        row = self.segment.lines[self.rank, 2:2 + STATE_WORDS]
        row[:] = 0
        row[:len(state)] = state
        counts[self.rank] = seq
        self.seq = seq
        return frame
