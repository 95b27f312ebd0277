"""`release_memory` / `resume_memory` as the manager runs them (docs/weights.md, "Releasing memory").

Inside a pause, or with no loop running, every rank's caller runs its share at once (the pause lends it the
groups). Otherwise the driver's call goes through its loop: the loop thread checks that scheduling is held (a
client's pause), sends a CALL plan whose data names the call, and runs its share while every worker runs its own
from that plan; a worker rank's call is then a no-op returning None (as its `add_request`). While anything is
released the driver runs no step (requests queue); the KV cache's release preempts every request holding device
pages (recomputed after the resume)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Iterable

from cluster.errors import Code, MemoryCallRefused
from driver.api.loop_calls import LoopCalls
from worker.memory_release import KV_CACHE, TAGS, MemoryCall, RankMemory, check_call, run_memory_call



def answer(result: dict[str, Any]) -> dict[str, Any]:
    """The result of a memory call, or MemoryCallRefused (its `code`, the first refusing `rank`)."""
    if result.get("ok") is True:
        return result
    raise MemoryCallRefused(str(result.get("code") or Code.INTERNAL), str(result.get("error")), result.get("rank"),
                            result)


class MemoryCalls:
    def __init__(self, manager: Any):
        self.m = manager
        self.rank = RankMemory(manager.runner)
        self.calls = LoopCalls(manager, "memory call")  # the driver's: calls queued for the loop

    @property
    def released(self) -> list[str]:
        """The tags this rank holds released (the same on every rank); while any is, the driver runs no step."""
        return self.rank.released

    def call(self, action: str, tags: Iterable[str] = TAGS, keep_weights_on_host: bool = True,
             timeout: float | None = None) -> dict[str, Any] | None:
        """Release or resume `tags` on every rank (the manager's `release_memory` / `resume_memory`). Every rank
        calls it inside a pause (or with no loop running); outside, the driver's call runs through its loop and a
        worker's returns None. Raises MemoryCallRefused with the code of the refusal, on every rank alike."""
        m = self.m
        call = MemoryCall(action, list(tags), bool(keep_weights_on_host))
        try:
            check_call(call)
        except ValueError as e:
            raise MemoryCallRefused(Code.BAD_FIELD, str(e)) from None
        if m.gate.held or not m.is_running():  # this thread may use the groups, in the same order on every rank
            return answer(self.run(call))
        if not m.is_driver:
            return None
        return answer(self.calls.wait(self.calls.queue("memory", call), timeout))

    def call_async(self, call: MemoryCall, done: Callable[[dict], None]) -> None:
        """The front door's path (driver only): `done(result dict)` from the loop thread, refusals included."""
        self.calls.queue_answered("memory", call, done)

    def run(self, call: MemoryCall) -> dict[str, Any]:
        """This rank's share, and on the driver the engine's bookkeeping. Every rank calls it at the same boundary."""
        result = run_memory_call(self.rank, self.m.groups, call)
        if result["ok"] and self.m.is_driver and call.action == "release" and KV_CACHE in call.tags:
            engine = self.m.engine
            engine.blocks.forget_cached_prefixes()  # the pages' contents are gone
            for req in reversed([r for r in engine.scheduler.running if r.block_ids]):
                engine.scheduler.preempt(req)  # recomputed after the resume (a host-pool copy stays valid)
        return result

    def run_on_driver(self, call: MemoryCall, fut: Future, send: Callable[[], None]) -> None:
        """The driver loop's share (its loop thread only): a release needs scheduling held (else refused, and no
        plan is sent); then `send()` sends the CALL plan and this rank runs its share. An exception (a collective
        that failed) goes to the caller and ends the loop."""
        if call.action == "release" and not self.m.held:
            self.calls.settle(fut, {"ok": False, "code": Code.NOT_PAUSED, "rank": None,
                               "error": "release_memory needs a paused engine: inside pause(), or while a client "
                                        "holds the serving pause"})
            return
        send()
        self.calls.answer(fut, lambda: self.run(call))

    def worker_call(self, call: MemoryCall) -> None:
        """A worker's share of a call the driver sent in a CALL plan (the worker loop thread). Its result is the
        driver's too (the votes make it so); an exception ends the loop."""
        self.run(call)

