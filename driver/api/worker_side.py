"""A worker rank's loop thread, as its manager runs it: execute every plan (worker/loop.py) and act on what
plans carry for this rank's callers: outputs they read, and weight-update calls.

A worker whose loop dies stops stamping liveness at once, so when the driver's pending collective fails
(the process exits, or the group's timeout passes) it names this rank; the manager refuses new work.
"""

from __future__ import annotations

import logging
from typing import Any

import msgpack

from cluster.outputs import GenerationOutput
from worker.loop import worker_loop
from worker.weights import UpdateCall

log = logging.getLogger("lockstep")


def run_worker_side(m: Any) -> None:
    """The loop thread of a non-driver rank's manager; returns at STOP or when the loop fails."""
    try:
        for plan in worker_loop(m.runner, m.groups, m.gate, m.barrier, lambda: m.wants_results, m.liveness):
            data = msgpack.unpackb(plan.data)
            for d in data.get("outputs", []):
                m.results.put(GenerationOutput.from_dict(d))
            if "call" in data:
                m.updates.worker_call(UpdateCall(**data["call"]), plan.weight_version)
    except BaseException as e:  # never silently: the driver must be able to name this rank
        m.loop_error = e
        m.failure = f"rank {m.groups.rank}: worker loop failed: {type(e).__name__}: {str(e)[:300]}"
        log.exception("lockstep worker loop failed")
        if m.liveness is not None:
            m.liveness.stop()
