"""Calls a user thread hands to the driver's loop (weight updates, memory calls): each is queued in the manager's
inbox with a Future and answered exactly once, by the loop, or with ManagerStopped when the loop ends (or is found
stopped) before it ran the call. Driver only; no collective runs here."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable

from cluster.errors import Code, ManagerStopped

POLL_S = 0.25  # how often a waiting caller looks whether the loop still runs


class LoopCalls:
    def __init__(self, manager: Any, what: str):
        self.m, self.what = manager, what  # `what`: the call's name in errors ("weight update", "memory call")
        self.lock = threading.Lock()
        self.pending: set[Future] = set()  # queued for the loop, not yet answered

    def queue(self, kind: str, *payload: Any) -> Future:
        """Put (kind, (*payload, future)) in the loop's inbox; the future is the call's answer."""
        fut: Future = Future()
        with self.lock:
            self.pending.add(fut)
        self.m.inbox.put((kind, (*payload, fut)))
        return fut

    def queue_answered(self, kind: str, call: Any, done: Callable[[dict], None]) -> None:
        """The front door's path (driver only): queue `call`, then `done(result dict)` from the loop thread; an
        exception is answered as {"ok": False, "code", "error"}."""
        def finished(f: Future) -> None:
            e = f.exception()
            done(f.result() if e is None else {"ok": False, "code": getattr(e, "code", Code.INTERNAL),
                                               "error": str(e)})

        self.queue(kind, call).add_done_callback(finished)

    def answer(self, fut: Future, run: Callable[[], dict]) -> None:
        """Settle `fut` with `run()` (the loop thread's share of a call); an exception (a collective that failed)
        goes to the caller and is raised again, which ends the loop."""
        try:
            result = run()
        except BaseException as e:
            self.settle(fut, error=e)
            raise
        self.settle(fut, result)

    def wait(self, fut: Future, timeout: float | None) -> dict[str, Any]:
        """The loop's answer; ManagerStopped if the loop ends without answering, TimeoutError after `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                return fut.result(POLL_S if left is None else max(0.0, min(POLL_S, left)))
            except TimeoutError:
                if fut.done():
                    continue
                if not self.m.is_running():
                    self.settle(fut, error=ManagerStopped(f"the loop stopped before it ran this {self.what}"))
                    continue
                if left is not None and left <= 0:
                    raise TimeoutError(f"the {self.what} did not finish in time") from None

    def settle(self, fut: Future, result: dict | None = None, error: BaseException | None = None) -> None:
        """Answer a queued call once (its callbacks run here, outside the lock)."""
        with self.lock:
            self.pending.discard(fut)
        try:
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)
        except InvalidStateError:
            pass  # answered already: the loop's answer and loop_ended (or a waiter) raced

    def loop_ended(self) -> None:
        """Answer every call the loop left unanswered."""
        with self.lock:
            pending = list(self.pending)
        for fut in pending:
            self.settle(fut, error=ManagerStopped(f"the loop ended before it ran this {self.what}"))
