"""Weight updates as the manager runs them, on every rank.

The driver decides when: a user's `update_weights` (or the front door's) goes into the inbox, and the loop thread
sends a CALL plan and runs its share. A worker rank's caller waits here for its share's result, which the worker
loop computes when that CALL plan arrives. Inside a pause, or with no loop running, the calling thread itself may
use the groups and runs the update at once. A rank that fails while copying makes every rank raise
`WeightsDiverged`, which ends the loop (and every later update on this manager raises it again)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from cluster.errors import Code, ManagerStopped, WeightUpdateError
from driver.engine.staleness import enforce_weight_lag
from driver.api.loop_calls import POLL_S, LoopCalls
from worker.weights import UpdateCall, WeightsDiverged, run_update



class WeightUpdates:
    def __init__(self, manager: Any):
        self.m = manager
        self.cond = threading.Condition()
        self.results: list[Any] = []  # a worker's: results (or exceptions) of the driver's CALLs, in order
        self.taken = 0  # a worker's: callers that waited for a result so far
        self.tensors: list[dict] = []  # a worker's: tensors its callers handed over, for the next CALLs
        self.calls = LoopCalls(manager, "weight update")  # the driver's: updates queued for the loop
        self.version = 0  # the weight version this rank holds
        self.attempts = 0  # updates this rank has run (fault rules match on it)
        self.diverged: WeightsDiverged | None = None
        self.ended: list = []  # the driver's: requests an update ended (stale), for the loop to emit (take_ended)

    def update_weights(self, source: Any, kv_policy: str = "keep", timeout: float | None = None,
                       partial: bool = False) -> dict[str, Any]:
        """Swap the weights at one step boundary on every rank, all or none, and bump the weight version. Every rank
        calls it. `source`: a checkpoint directory or a dict of full tensors with transformers' names (`partial`:
        any subset of the model's names; refused names raise WeightUpdateError with `reason_code`). In-flight
        requests keep their KV (kv_policy="keep") or recompute it ("recompute"). Returns {"ok": True, "version",
        "tensors", "seconds"}; raises, on every rank alike, WeightUpdateError (nothing changed anywhere; `rank` is
        the first rank that refused) or WeightsDiverged (a rank failed while copying: the loop ends)."""
        m = self.m
        if kv_policy not in ("keep", "recompute"):
            raise ValueError(f"kv_policy={kv_policy!r}: must be 'keep' or 'recompute'")
        if self.diverged is not None:
            raise self.diverged
        local = source if isinstance(source, dict) else None
        call = UpdateCall(source="tensors" if local is not None else "checkpoint",
                          path="" if local is not None else str(source), kv_policy=kv_policy, partial=partial)
        # inside a pause (this rank's loop is parked for the caller's own entry), or with no loop: this thread
        # may use the groups, in the same order on every rank: every rank's caller runs its share now
        if m.gate.held or not m.is_running():
            try:
                result = self._run(call, local, expected=None)
            except WeightsDiverged:
                m.stop(block=False, hard_stop=True)  # the loop must not serve on with differing weights
                raise
            result = self.after_update(result, call) if m.is_driver else result
        elif not m.is_driver:  # the driver decides when; this rank's share runs in its loop
            result = self._wait_worker_share(local, timeout)
        else:
            result = self.calls.wait(self.calls.queue("update", call, local), timeout)
        if not result["ok"]:
            raise WeightUpdateError(result["error"], result.get("rank"), result)
        return result

    def _run(self, call: UpdateCall, local: dict | None, expected: int | None) -> dict[str, Any]:
        """This rank's share: run_update with this rank's version, then bump it if every rank applied (a trainer
        group's bucket that does not end its update applies nothing: worker/trainer_groups.py)."""
        self.attempts += 1
        self.m.memory.rank.before_update()  # released weights get their storage back (memory_calls.py)
        trainer = self.m.trainer_groups
        try:
            result = run_update(self.m.model.model, self.m.groups, call, local, version=self.version,
                                expected=expected, attempt=self.attempts, trainer=trainer)
        except WeightsDiverged as e:
            self.diverged = e
            raise
        if call.source == "group":
            trainer.settle(call.group_name, result)
        applied = result["ok"] and result["applied"]
        self.m.memory.rank.after_update(applied, call.partial)
        if applied:
            self.version += 1
            # every tensor a captured CUDA graph reads must still be where it was captured, or the graphs would
            # replay on stale storage and serve garbage: a move ends this rank's loop
            moved = self.m.runner.check_graph_addresses()
            if moved:
                rank = self.m.groups.rank
                self.diverged = WeightsDiverged(f"rank {rank}: the update moved {len(moved)} tensor(s) that captured"
                                                f" CUDA graphs read, e.g. {moved[:3]}; refusing to serve", [rank])
                raise self.diverged
        return result | {"version": self.version}

    def _wait_worker_share(self, local: dict | None, timeout: float | None) -> dict[str, Any]:
        m = self.m
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            if local is not None:
                self.tensors.append(local)
                self.cond.notify_all()
            mine, self.taken = self.taken, self.taken + 1
            while len(self.results) <= mine:
                if not m.is_running():
                    raise ManagerStopped("the loop stopped before the driver ran this weight update")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("no weight update came from the driver")
                self.cond.wait(POLL_S if left is None else min(POLL_S, left))
            result = self.results[mine]
        if isinstance(result, BaseException):
            raise result
        return result

    def update_weights_async(self, call: UpdateCall, done: Callable[[dict], None]) -> None:
        """The front door's path (driver only): `done(result dict)` from the loop thread, failures included."""
        def finished(f: Future) -> None:
            e = f.exception()
            if e is None:
                done(f.result())
                return
            ranks = getattr(e, "ranks", None) or [None]
            done({"ok": False, "error": str(e), "rank": ranks[0], "code": getattr(e, "code", Code.INTERNAL),
                  "version": self.version})

        call.callers = False  # no worker-side caller waits for this one's result
        self.calls.queue("update", call, None).add_done_callback(finished)

    def run_on_driver(self, call: UpdateCall, local: dict | None, fut: Future) -> None:
        """The driver loop's share, right after it sent the CALL plan (the driver's loop thread only). An
        exception (WeightsDiverged, a collective that failed) goes to the caller and ends the loop."""
        try:
            result = self._run(call, local, expected=self.m.engine.weight_version)
        except BaseException as e:
            self.calls.settle(fut, error=e)
            raise
        self.calls.settle(fut, result=self.after_update(result, call))

    def planned(self, call: UpdateCall) -> UpdateCall:
        """The driver's word on a trainer group's bucket, before its CALL plan goes out (the loop thread): it
        applies the update when the staged tensors and this bucket's complete the model, or when it says `end`
        (then a subset is a partial update). Every rank's share follows the plan."""
        if call.source == "group":
            complete = self.m.trainer_groups.completes(self.m.model.model, call.buckets[0])
            call.apply, call.partial = complete or call.end, not complete
        return call

    def after_update(self, result: dict[str, Any], call: UpdateCall) -> dict[str, Any]:
        """Driver bookkeeping once every rank agreed: version, stale prefix pages, in-flight KV."""
        e = self.m.engine
        if result["ok"] and result["applied"]:
            e.weight_version += 1
            e.blocks.forget_cached_prefixes()
            self.ended += enforce_weight_lag(e, call.kv_policy)  # before the KV policy: a restart frees its KV
            if call.kv_policy == "recompute":
                e.scheduler.retract()
            else:  # every request holding KV, on the device or swapped out to the host pool
                for req in [r for r in e.scheduler.running if r.block_ids] + list(e.scheduler.host.held):
                    req.cacheable = False
        return result | {"version": e.weight_version}

    def take_ended(self) -> list:
        """The requests updates ended since the last call (the driver's loop thread emits them)."""
        ended, self.ended = self.ended, []
        return ended

    def worker_call(self, call: UpdateCall, plan_version: int) -> None:
        """A worker's share of an update the driver started (the worker loop thread, after its CALL plan); tensors
        come from this rank's caller. An exception goes to the caller and ends the loop."""
        local = None
        if call.source == "tensors":
            with self.cond:
                self.cond.wait_for(lambda: bool(self.tensors), call.timeout_s)
                local = self.tensors.pop(0) if self.tensors else None
        try:
            result: Any = self._run(call, local, expected=plan_version)
        except BaseException as e:
            result = e
            raise
        finally:
            if call.callers or isinstance(result, BaseException):
                with self.cond:
                    self.results.append(result)
                    self.cond.notify_all()

    def loop_ended(self) -> None:
        """Wake callers waiting for a CALL that will never come, and answer every update the loop left unanswered."""
        with self.cond:
            self.cond.notify_all()
        self.calls.loop_ended()
