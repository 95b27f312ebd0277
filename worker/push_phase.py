"""Where a serving rank is in a trainer's push, so a push that breaks says where (raw NCCL has no timeout, TRL #6913):
every wait of a push (the store, the group's rendezvous, each bucket's broadcast, the final agreement) is bounded by
`push_timeout_s`, and the rank that gives up refuses the update naming the phase it was in."""

from __future__ import annotations

import time

from cluster.errors import Code, WeightRefused

SLACK_S = 0.05  # a wait that ended this close to the timeout timed out (the backends count in milliseconds)


class PushPhase:
    """The phase a rank's push is in (handshake, group, bucket i/n, agree) and since when."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.name, self.since = "handshake", time.monotonic()

    def enter(self, name: str) -> None:
        self.name, self.since = name, time.monotonic()

    def gave_up(self, e: BaseException) -> WeightRefused:
        """The refusal for a wait of this phase that raised `e`: push_timeout when it lasted push_timeout_s (a
        member went silent: stopped, hung), push_failed when it ended sooner (a member went away or failed)."""
        waited = time.monotonic() - self.since
        timed_out = waited >= self.timeout_s - SLACK_S
        what = f"timed out (push_timeout_s={self.timeout_s:g})" if timed_out else "failed"
        return WeightRefused(f"the push {what} in phase {self.name} after {waited:.1f} s: {type(e).__name__}: "
                             f"{str(e)[:200]}", Code.PUSH_TIMEOUT if timed_out else Code.PUSH_FAILED, phase=self.name)
