"""The worker loop: receive a plan, do what it says, repeat. Workers keep no request state."""

from __future__ import annotations

from typing import Callable, Iterator

from cluster.dist import Groups, recv_plan
from cluster.pause import PauseGate
from cluster.plan import Command, StepPlan
from worker.runner import ModelRunner


def worker_loop(runner: ModelRunner, groups: Groups, gate: PauseGate,
                barrier: Callable[[], None]) -> Iterator[StepPlan]:
    """Every non-driver rank runs it while its manager is started; it returns at STOP.

    Plans that carry data for the caller (PUBLISH, CALL) are yielded; the rest are handled here.
    """
    while True:
        plan = recv_plan(groups)
        if plan.command == Command.STEP:
            runner.execute(plan)
        elif plan.command == Command.PAUSE:
            gate.park(barrier, lambda: True)
        elif plan.command == Command.STOP:
            return
        elif plan.command in (Command.PUBLISH, Command.CALL):
            yield plan
