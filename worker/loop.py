"""The worker loop: receive a plan, do what it says, repeat. Workers keep no request state."""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from cluster import faults
from cluster.dist import Groups, recv_plan
from cluster.liveness import Liveness
from cluster.pause import PauseGate
from cluster.plan import STATE_MAGIC, Command, S, StepPlan
from worker.runner import ModelRunner
from worker.packed_linear import weights_changed


def worker_loop(runner: ModelRunner, groups: Groups, gate: PauseGate, barrier: Callable[[], None],
                wants_results: Callable[[], bool], liveness: Liveness | None = None) -> Iterator[StepPlan]:
    """Every non-driver rank runs it while its manager is started; it returns at STOP. Plans that carry data
    (results, calls) are yielded to the caller. An overlapped STEP plan (`share_tokens`) is only queued on the
    runner's stream, so this rank receives the next plan and prepares its inputs while the forward runs."""
    state = np.zeros(len(S), np.int64)
    state[S.MAGIC] = STATE_MAGIC
    while True:
        state[S.WANTS_RESULTS] = int(wants_results())
        plan = recv_plan(groups, state)
        state[S.LAST_STEP] = plan.step
        if liveness is not None:
            liveness.step = plan.step
        if plan.data:
            yield plan
        if plan.command == Command.STEP:
            faults.hit("worker_execute", rank=groups.rank, step=plan.step)
            if plan.share_tokens:  # overlapped: queue the forward(s), each followed by the broadcast of its tokens
                runner.share_burst(runner.launch(plan), None)
            else:
                runner.execute(plan)
        elif plan.command == Command.PAUSE:
            gate.park(barrier, lambda: True, groups.lent)
            weights_changed()  # the pause's holders may have written the weights in place (named_shards views)
        elif plan.command == Command.STOP:
            return
