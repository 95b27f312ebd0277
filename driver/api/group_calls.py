"""A weight-sync group the trainer owns, as the manager runs its calls (docs/weights.md, "A weight-sync group the
trainer owns"): joining and leaving it (`init`, `destroy`) go through the driver's loop, which sends a CALL plan
whose data names the call and runs its share while every worker runs its own from that plan
(worker/trainer_groups.py; every rank joins or leaves, or none does). The buckets of an update are weight updates
(update_calls.py, source "group"). A loop that ends leaves every group (`close`)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

from driver.api.loop_calls import LoopCalls
from worker.trainer_group import GroupCall


class GroupCalls:
    def __init__(self, manager: Any):
        self.m = manager
        self.calls = LoopCalls(manager, "weights group call")  # the driver's: calls queued for the loop

    def call_async(self, call: GroupCall, done: Callable[[dict], None]) -> None:
        """The front door's path (driver only): `done(result dict)` from the loop thread, refusals included."""
        self.calls.queue_answered("group", call, done)

    def run(self, call: GroupCall) -> dict[str, Any]:
        """This rank's share. Every rank calls it at the same boundary (collectives: TrainerGroups.run)."""
        return self.m.trainer_groups.run(call, self.m.groups)

    def run_on_driver(self, call: GroupCall, fut: Future, send: Callable[[], None]) -> None:
        """The driver loop's share (its loop thread only): `send()` sends the CALL plan, then this rank runs its
        share; an exception (a collective that failed) goes to the caller and ends the loop."""
        send()
        self.calls.answer(fut, lambda: self.run(call))

    def worker_call(self, call: GroupCall) -> None:
        """A worker's share of a call the driver sent in a CALL plan (the worker loop thread); its result is the
        driver's too (the votes make it so)."""
        self.run(call)
