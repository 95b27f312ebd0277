"""Weight updates as the manager runs them, on every rank.

The driver decides when: a user's `update_weights` (or the front door's) goes into the inbox, and the loop
thread sends a CALL plan and runs its share. A worker rank's caller waits here for its share's result, which
the worker loop computes when that CALL plan arrives (tensors handed in by the caller ride along). Inside a
pause, or with no loop running, the calling thread itself may use the groups, and runs the update at once.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable

from worker.weights import UpdateCall, run_update


class WeightUpdates:
    def __init__(self, manager: Any):
        self.m = manager
        self.cond = threading.Condition()
        self.results: list[dict] = []  # a worker's: results of the driver's CALLs, in order
        self.taken = 0  # a worker's: callers that waited for a result so far
        self.tensors: list[dict] = []  # a worker's: tensors its callers handed over, for the next CALLs

    def update_weights(self, source: Any, kv_policy: str = "keep", timeout: float | None = None) -> dict[str, Any]:
        """Swap the weights at one step boundary on every rank, all or none, and bump the weight version.
        Every rank calls it. `source` is a checkpoint directory (each rank reads its slices) or a dict of full
        tensors with transformers' names. Inside `pause()` it runs at once; otherwise at the next boundary.
        In-flight requests keep their KV (kv_policy="keep") or recompute it under the new weights
        ("recompute"). Returns {"ok", "version", "error", "seconds", ...}; nothing changes when ok is False."""
        m = self.m
        if kv_policy not in ("keep", "recompute"):
            raise ValueError(f"kv_policy={kv_policy!r}: must be 'keep' or 'recompute'")
        local = source if isinstance(source, dict) else None
        call = UpdateCall(source="tensors" if local is not None else "checkpoint",
                          path="" if local is not None else str(source), kv_policy=kv_policy)
        if m.gate.parked or not m.is_running():  # the loops are parked: this thread may use the groups
            result = run_update(m.model.model, m.groups, call, local)
            return self.after_update(result, call) if m.is_driver else result
        if not m.is_driver:  # the driver decides when; this rank's share runs in its loop
            with self.cond:
                if local is not None:
                    self.tensors.append(local)
                    self.cond.notify_all()
                mine = self.taken
                self.taken += 1
                if not self.cond.wait_for(lambda: len(self.results) > mine or not m.is_running(), timeout):
                    raise TimeoutError("no weight update came from the driver")
                if len(self.results) <= mine:
                    raise RuntimeError("the loop stopped before the driver ran this weight update")
                return self.results[mine]
        fut: Future = Future()
        m.inbox.put(("update", (call, local, fut)))
        return fut.result(timeout)

    def update_weights_async(self, call: UpdateCall, done: Callable[[dict], None]) -> None:
        """The front door's path (driver only): `done(result)` is called from the loop thread."""
        fut: Future = Future()
        fut.add_done_callback(lambda f: done(f.result()))
        self.m.inbox.put(("update", (call, None, fut)))

    def run_on_driver(self, call: UpdateCall, local: dict | None, fut: Future) -> None:
        """The driver loop's share, right after it sent the CALL plan (the driver's loop thread only)."""
        result = run_update(self.m.model.model, self.m.groups, call, local)
        fut.set_result(self.after_update(result, call))

    def after_update(self, result: dict[str, Any], call: UpdateCall) -> dict[str, Any]:
        """Driver bookkeeping once every rank agreed: version, stale prefix pages, in-flight KV."""
        e = self.m.engine
        if result["ok"]:
            e.weight_version += 1
            e.blocks.forget_cached_prefixes()
            holding = [r for r in e.scheduler.running if r.block_ids]
            if call.kv_policy == "recompute":
                for req in reversed(holding):
                    e.scheduler.preempt(req)
            else:
                for req in holding:
                    req.cacheable = False
        return result | {"version": e.weight_version}

    def worker_call(self, call: UpdateCall, plan_version: int) -> None:
        """A worker's share of an update the driver started (the worker loop thread, after a CALL plan whose
        weight_version is `plan_version`); tensors come from this rank's caller."""
        local = None
        if call.source == "tensors":
            with self.cond:
                self.cond.wait_for(lambda: bool(self.tensors), call.timeout_s)
                local = self.tensors.pop(0) if self.tensors else None
        result = run_update(self.m.model.model, self.m.groups, call, local)
        with self.cond:
            self.results.append(result)
            self.cond.notify_all()

    def loop_ended(self) -> None:
        """Wake every caller waiting for a CALL that will never come (the loop stopped or died)."""
        with self.cond:
            self.cond.notify_all()
