"""Rank-local pause bookkeeping of the driver's and the workers' loops: a loop parks at a step boundary (after
a PAUSE plan) until this rank's `pause()` caller for that park has come and gone, with a barrier on each side,
so every rank's caller is inside while every loop is parked and no loop moves on while any caller is inside."""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator

# what a pause does to the requests the engine holds (docs/weights.md, "Pause modes"): "keep" freezes them with their
# KV, "abort" ends them with their partial output, "wait" stops admitting and lets the running ones finish first,
# "retract" frees their KV and sends them back to waiting (re-prefilled on resume)
PAUSE_MODES = ("keep", "abort", "wait", "retract")


def check_pause_mode(mode: object) -> str:
    """`mode` if it is one of PAUSE_MODES, else ValueError naming it."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode={mode!r}: must be one of {', '.join(PAUSE_MODES)}")
    return str(mode)


class PauseGate:
    """Entries and parks are numbered: the k-th entry made while a loop runs belongs to the k-th park (the k-th
    PAUSE plan), on every rank alike. An entry waits for its own park, and a park lasts until its own entry
    has left, so a caller that leaves one pause and enters the next at once can never be absorbed by the
    park that is ending (its collectives would meet the other ranks' barrier instead of their callers)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.holders = 0  # callers inside pause() or waiting to enter it
        self.entries = 0  # entries made while a loop ran
        self.exits = 0  # of those, the ones that left
        self.parks = 0  # parks begun
        self.parked = False
        self.modes: dict[int, str] = {}  # entry number -> the pause mode its caller named

    @property
    def requested(self) -> bool:
        with self.cond:
            return self.holders > 0

    @property
    def held(self) -> bool:
        """A caller is inside the current park: collectives from the pause's holders are in order now."""
        with self.cond:
            return self.parked and self.entries == self.parks and self.exits < self.parks

    @property
    def next_mode(self) -> str:
        """The mode named by the entry the next park belongs to ("keep" when it named none)."""
        with self.cond:
            return self.modes.get(self.parks + 1, "keep")

    @contextmanager
    def hold(self, loop_alive: Callable[[], bool], mode: str = "keep") -> Iterator[None]:
        """Enter once this rank's loop is parked for this entry (at once if no loop runs), until it leaves. `mode`
        (PAUSE_MODES) is what the driver's loop does to its requests before that park."""
        with self.cond:
            self.holders += 1
            counted = loop_alive()  # with no loop there is no park to wait for, or to release later
            if counted:
                self.entries += 1
                ticket = self.entries
                self.modes[ticket] = mode
            self.cond.notify_all()
            while counted and loop_alive() and not (self.parked and self.parks == ticket):
                self.cond.wait(0.05)
        try:
            yield
        finally:
            with self.cond:
                self.holders -= 1
                if counted:
                    self.exits += 1
                self.cond.notify_all()

    def park(self, barrier: Callable[[], None], still_alive: Callable[[], bool],
             lend: Callable[[], ContextManager] = nullcontext) -> None:
        """The loop thread, after a PAUSE plan: returns once this park's entry has come and gone on every rank
        (the barriers; every rank calls it). `lend()` (the groups' `lent`) lets the holders run collectives."""
        barrier()
        with lend(), self.cond:
            self.parks += 1
            self.modes.pop(self.parks, None)
            self.parked = True
            self.cond.notify_all()
            while still_alive() and self.exits < self.parks:
                self.cond.wait(0.05)
            self.parked = False
            self.cond.notify_all()
        barrier()
