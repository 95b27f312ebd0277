"""Rank 0's loop thread: the only thread of the driver that talks on the control group while it runs.

Each pass: take what users left in the inbox, park for a pause, run one engine step, and make sure some plan reaches
the workers at least every IDLE_HEARTBEAT_S, whatever the inbox does (a worker waiting in `recv_plan` longer than
`cpu_group_timeout` would take the group down). How a dying loop names the fault: docs/architecture.md, "The
lockstep rules"."""

from __future__ import annotations

import logging
import queue
import time
import traceback
from typing import Any, Callable

import msgpack

from cluster import faults
from cluster.config import IDLE_HEARTBEAT_S
from cluster.errors import Code, LockstepError
from cluster.outputs import RequestStatus
from cluster.plan import Command
from driver.api.pause_modes import PauseModes
from driver.engine.request import Request
from worker.packed_linear import weights_changed

log = logging.getLogger("lockstep")


def is_collective_error(error: BaseException) -> bool:
    """The error came out of a torch.distributed call (a peer died, hung, or the group broke)."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return any("torch/distributed/" in frame.filename.replace("\\", "/")
               for frame in traceback.extract_tb(error.__traceback__))


class DriverLoop:
    def __init__(self, manager: Any):
        self.m = manager
        self.engine = manager.engine
        self.outbox: list[dict] = []  # outputs owed to worker ranks whose callers read results
        self.last_plan = time.monotonic()  # when the workers last heard from us
        self.pauses = PauseModes(self.engine, self.emit)
        # the serving pause asked for (hold_scheduling): its mode and who hears when it is in force (None: none)
        self.hold_asked: tuple[str, Callable[[bool], None] | None] | None = None

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        m, engine = self.m, self.engine
        try:
            while True:
                m.loop_beat = time.monotonic()
                if self._holding():  # a held loop runs no step: collect the one in flight now, not at the next plan
                    self._flush()
                idle = self._holding() or not engine.has_work()
                wait = idle and not m.stop_event.is_set() and not m.gate.requested
                self._drain_inbox(self._until_heartbeat() if wait else 0.0)
                self._hold()
                if m.gate.requested and self._ready("manager", m.gate.next_mode):
                    self._send(Command.PAUSE)
                    m.gate.park(m.barrier, lambda: True, m.groups.lent)
                    weights_changed()  # the holders may have written the weights in place: packed copies are stale
                    self.pauses.leave("manager")
                    self.last_plan = time.monotonic()  # the barriers were plans' worth of contact
                    # the holders may have changed the weights: cached prefixes no longer match them
                    engine.blocks.forget_cached_prefixes()
                    self._emit_all(m.updates.take_ended())  # stale requests of an update run inside the pause
                    continue
                if m.stop_event.is_set() and (m.hard or not engine.has_work() or m.memory.released):
                    break
                if engine.has_work() and not self._holding():  # after _hold(): a hold in force now
                    self._step()
                elif self.outbox:
                    self._send(Command.PUBLISH)
                if time.monotonic() - self.last_plan >= IDLE_HEARTBEAT_S:
                    self._send(Command.IDLE)  # by the clock, not by an empty inbox
            why = "the manager was stopped with hard_stop=True" if m.hard else "the manager stopped before it ran"
            self._close(RequestStatus.FAILED, why, Code.STOPPED)
            self._send(Command.STOP)
        except BaseException as e:  # the loop must never die silently
            self._fail(e)

    def _holding(self) -> bool:
        """No step runs: a serving pause is in force, or memory is released until it is resumed."""
        return self.m.held or bool(self.m.memory.released)

    def _ready(self, who: str, mode: str) -> bool:
        """Collect the step in flight, then act on the pause's mode (pause_modes.py): True once it may take effect."""
        self._flush()
        return self.pauses.ready(who, mode)

    def _hold(self) -> None:
        """Put the serving pause asked for in force once its mode allows (`m.held`: nothing steps), and say so."""
        m = self.m
        if self.hold_asked is None or m.held:
            return
        if m.stop_event.is_set():  # a stop ends the serving pause (`stop` let go of `held`): what is queued runs
            self.hold_asked = None
            self.pauses.leave("serving")
            return
        mode, done = self.hold_asked
        m.held = self._ready("serving", mode)
        if m.held and done is not None:
            self.hold_asked = (mode, None)
            done(True)

    def _until_heartbeat(self) -> float:
        return max(0.0, self.last_plan + IDLE_HEARTBEAT_S - time.monotonic())

    def _send(self, command: Command, **extra: Any) -> None:
        """A plan that runs no forward, carrying the outbox (and `extra`); the step in flight is collected first."""
        self._flush()
        self.engine.send(command, self._take_outbox(**extra))
        self.last_plan = time.monotonic()

    def _flush(self) -> None:
        for req in self.engine.flush():
            self.emit(req)

    def _step(self) -> None:
        engine = self.engine
        faults.hit("driver_step", step=engine.step_no)
        before = engine.step_no
        for req in engine.step(self._take_outbox()):
            self.emit(req)
        if engine.step_no != before:
            self.last_plan = time.monotonic()
        if self.m.liveness:
            self.m.liveness.step = engine.step_no

    # ------------------------------------------------------------------ the inbox
    def _drain_inbox(self, timeout: float) -> None:
        try:
            item = self.m.inbox.get(timeout=timeout) if timeout > 0 else self.m.inbox.get_nowait()
            while True:
                self._handle(item)
                item = self.m.inbox.get_nowait()
        except queue.Empty:
            return

    def _handle(self, item: Any) -> None:
        if item is None:  # a wake-up
            return
        kind, arg = item
        if kind == "add":
            if not arg.is_finished:  # a cancel that overtook its add already ended it
                self.engine.scheduler.add(arg)
        elif kind == "update":
            call, local, fut = arg
            self._send(Command.CALL, call=self.m.updates.planned(call).to_dict())
            self.m.updates.run_on_driver(call, local, fut)
            self.last_plan = time.monotonic()
            self._emit_all(self.m.updates.take_ended())
        elif kind == "memory":
            call, fut = arg
            self.m.memory.run_on_driver(call, fut, lambda: self._send(Command.CALL, memory=call.to_dict()))
            self.last_plan = time.monotonic()
        elif kind == "group":  # a trainer-owned weight-sync group: join or leave (group_calls.py)
            call, fut = arg
            self.m.group_calls.run_on_driver(call, fut, lambda: self._send(Command.CALL, group=call.to_dict()))
            self.last_plan = time.monotonic()
        elif kind == "hold":  # the serving pause: (mode, done) to pause, None to resume
            if self.hold_asked is not None and self.hold_asked[1] is not None:
                self.hold_asked[1](False)  # superseded before it took effect
            self.hold_asked, self.m.held = arg, False
            if arg is None:
                self.pauses.leave("serving")
            self._hold()  # at this point of the inbox: what was queued after the pause is not aborted
        elif kind == "cancel":
            rid, reason = arg
            req = self.m.requests.get(rid)
            if req is not None and not req.is_finished:
                self.engine.end(req, RequestStatus.CANCELLED, "cancelled", reason=reason)
                self.emit(req)

    # ------------------------------------------------------------------ outputs
    def emit(self, req: Request) -> None:
        """Hand a request's output to its sink (or the result router) and to the workers that read results."""
        self.m.metrics.observe(req)
        if not (req.is_finished or req.streaming):
            return
        if req.is_finished:
            with self.m._lock:
                self.m.requests.pop(req.request_id, None)
        out = req.output()
        if req.sink is not None:
            req.sink(out)
        else:
            self.m.results.put(out)
        if self.engine.workers_want_results():
            self.outbox.append(out.to_dict())

    def _emit_all(self, reqs: list[Request]) -> None:
        for req in reqs:
            self.emit(req)

    def _take_outbox(self, **extra: Any) -> bytes:
        """Outputs owed to the workers (and `extra` keys, such as a call), packed for the next plan."""
        if not self.outbox and not extra:
            return b""
        data, self.outbox = msgpack.packb({"outputs": self.outbox, **extra}), []
        return data

    # ------------------------------------------------------------------ endings
    def _close(self, status: RequestStatus, error: str, code: str) -> None:
        """Refuse new requests, then end every outstanding one (and every queued call) with `error`."""
        m = self.m
        with m._lock:
            m.closed = True
            left = list(m.requests.values())
        while True:  # what was queued before the door closed: adds end below (they are in m.requests);
            try:     # queued updates are answered by WeightUpdates.loop_ended once this loop has returned
                m.inbox.get_nowait()
            except queue.Empty:
                break
        for req in left:
            if not req.is_finished:
                self.engine.end(req, status, error)
                req.error_code = code
                self.emit(req)

    def _fail(self, error: BaseException) -> None:
        m, engine = self.m, self.engine
        m.loop_error = error
        engine.in_flight = None  # never wait on a step in flight here: its requests end below
        silent = [] if isinstance(error, LockstepError) or m.liveness is None else m.liveness.silent_ranks()
        if isinstance(error, LockstepError):  # it says itself what went wrong (weights diverged ...)
            code, m.failure = error.code, f"the driver stopped at step {engine.step_no}: {error}"
        elif silent:  # a hung rank is killed, so the launcher restarts the group now (docs/recovery.md)
            killed = m.liveness.condemn(silent)
            code, m.failure = Code.RANK_FAILED, m.liveness.describe(silent, engine.step_no, error, killed)
        elif is_collective_error(error):
            code = Code.RANK_FAILED
            m.failure = (f"a collective failed at step {engine.step_no} and no rank is silent: "
                         f"{type(error).__name__}: {str(error)[:200]}")
        else:
            code = Code.DRIVER_FAILED
            m.failure = f"the driver failed at step {engine.step_no}: {type(error).__name__}: {str(error)[:300]}"
        m.failure_code = code
        log.error("lockstep driver loop failed: %s", m.failure, exc_info=error)
        self._close(RequestStatus.FAILED, m.failure, code)
        if code == Code.DRIVER_FAILED and m.groups.distributed:
            # the workers are healthy and waiting for a plan: tell them to leave now, not at their timeout
            try:
                self._send(Command.STOP)
            except Exception as stop_error:  # best effort: the process exits non-zero either way
                log.error("lockstep: the STOP after a driver failure did not reach the workers: %r", stop_error)
        if m.liveness is not None:  # this rank leaves on its own: a worker that names it does not kill it
            m.liveness.mark_down()
