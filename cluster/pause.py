"""Rank-local pause bookkeeping shared by the driver's and the workers' loops.

A loop parks at a step boundary (after a PAUSE plan), waits until this rank's `pause()` holders have come
and gone, and meets the other ranks at a barrier on each side of the park, so every rank's caller is inside
while every loop is parked, and no loop moves on while any rank's caller is still inside.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator


class PauseGate:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.holders = 0
        self.enters = 0
        self.consumed = 0
        self.parked = False

    @property
    def requested(self) -> bool:
        with self.cond:
            return self.holders > 0

    @contextmanager
    def hold(self, loop_alive: Callable[[], bool]) -> Iterator[None]:
        """Enter once this rank's loop is parked (at once if no loop runs); the loop resumes after the last exit."""
        with self.cond:
            self.holders += 1
            if loop_alive():  # with no loop there is no park to release: counting it would free a later one
                self.enters += 1
            self.cond.notify_all()
            while loop_alive() and not self.parked:
                self.cond.wait(0.05)
        try:
            yield
        finally:
            with self.cond:
                self.holders -= 1
                self.cond.notify_all()

    def park(self, barrier: Callable[[], None], still_alive: Callable[[], bool],
             lend: Callable[[], ContextManager] = nullcontext) -> None:
        """Called by the loop thread after a PAUSE plan; returns when every rank's holders have left.
        `lend()` is entered between the two barriers (the groups' `lent`: holders may run collectives)."""
        barrier()
        with lend(), self.cond:
            self.parked = True
            self.cond.notify_all()
            while still_alive() and (self.enters == self.consumed or self.holders > 0):
                self.cond.wait(0.05)
            self.consumed = self.enters
            self.parked = False
        barrier()
