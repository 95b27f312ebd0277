"""What a pause does to the requests the engine holds (docs/weights.md, "Pause modes"), on rank 0's loop thread.

Two pauses take a mode: `manager.pause(mode=...)` ("manager": every rank's caller enters and the loops park) and
the serving pause (`hold_scheduling`: Client.pause, HTTP /pause; "serving": nothing steps, workers get heartbeats).
The driver alone acts on the mode, at a step boundary with no step in flight, before the pause takes effect; what
it does reaches the other ranks only through later plans (an aborted request is never scheduled again, a retracted
one is prefilled again like any waiting request), so every rank keeps taking the same path."""

from __future__ import annotations

from typing import Callable

from cluster.outputs import RequestStatus
from driver.engine.engine import Engine
from driver.engine.request import Request


class PauseModes:
    def __init__(self, engine: Engine, emit: Callable[[Request], None]):
        self.engine, self.emit = engine, emit
        self.draining: set[str] = set()  # pauses of mode "wait" ("manager", "serving") that closed admission

    def ready(self, who: str, mode: str) -> bool:
        """Act on `mode` for the pause `who` (the loop thread, no step in flight). True once the pause may take
        effect: at once, but for "wait" only when nothing runs (admission stays closed until `leave`). Then every
        request the engine still holds notes the pause (GenerationOutput.pauses)."""
        sched = self.engine.scheduler
        if mode == "wait":
            self.draining.add(who)
            sched.admitting = False
            if sched.running:
                return False
        elif mode == "abort":  # every request the engine holds ends now, with what it has
            while sched.running or sched.waiting:  # a parent ended before its fork queues its n samples' children
                req = next(iter(sched.running or sched.waiting))
                req.pauses.append((len(req.generated), mode))
                self.engine.end(req, RequestStatus.CANCELLED, f"request {req.request_id}: aborted by a pause "
                                "(mode 'abort')", reason="abort")
                self.emit(req)
        elif mode == "retract":
            sched.retract()
        for req in [*sched.running, *sched.waiting]:
            req.pauses.append((len(req.generated), mode))
        return True

    def leave(self, who: str) -> None:
        """The pause `who` ended: admission goes on unless another pause still drains."""
        self.draining.discard(who)
        self.engine.scheduler.admitting = not self.draining
