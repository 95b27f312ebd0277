"""Who is still alive: each rank stamps (step, time) into the group's store from a small thread, so that when a
collective fails the driver can name the rank that died (a broken gloo group cannot say which peer it lost)."""

from __future__ import annotations

import atexit
import threading
import time
from contextlib import suppress

import torch.distributed as dist

from cluster.dist import Groups

PERIOD_S = 0.5


class Liveness:
    def __init__(self, groups: Groups, period_s: float = PERIOD_S):
        self.groups, self.period_s, self.step = groups, period_s, 0
        self.stop_event = threading.Event()
        self.store = dist.distributed_c10d._get_default_store() if groups.distributed else None
        self.thread = threading.Thread(target=self._run, name="lockstep-liveness", daemon=True)

    def start(self) -> "Liveness":
        if self.store is not None:
            self._stamp()
            self.thread.start()
            atexit.register(self.stop)  # runs before the groups' own teardown (registered earlier)
        return self

    def stop(self) -> None:
        """Stop stamping and wait for the thread, so no store call is in flight when the process exits."""
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(4 * self.period_s)

    def _stamp(self) -> None:
        self.store.set(f"lockstep/alive/{self.groups.rank}", f"{self.step} {time.time()}")

    def _run(self) -> None:
        while not self.stop_event.wait(self.period_s):
            try:
                self._stamp()
            except Exception:  # the store went away: the group is ending
                return

    def _stamps(self) -> dict[int, tuple[int, float]]:
        out = {}
        for rank in range(self.groups.world_size):
            key = f"lockstep/alive/{rank}"
            with suppress(Exception):
                if self.store.check([key]):
                    step, stamp = self.store.get(key).decode().split()
                    out[rank] = (int(step), float(stamp))
        return out

    def silent_ranks(self) -> list[tuple[int, int, float]]:
        """(rank, last step it reported, seconds since) for every other rank whose stamp stops moving: watched
        for three periods, so a rank that died a moment ago is caught as surely as one long gone."""
        first = self._stamps()
        deadline = time.time() + 3 * self.period_s
        silent = {r for r in range(self.groups.world_size) if r != self.groups.rank}
        while silent and time.time() < deadline:
            time.sleep(self.period_s / 2)
            now = self._stamps()
            silent = {r for r in silent if now.get(r) == first.get(r)}
        now_t = time.time()
        return [(r, first.get(r, (-1, 0.0))[0], now_t - first.get(r, (-1, 0.0))[1]) for r in sorted(silent)]

    def describe(self, silent: list[tuple[int, int, float]], step: int, error: BaseException) -> str:
        """One sentence naming the silent rank(s) (from `silent_ranks`), for every request's error."""
        who = "; ".join(f"rank {r} stopped answering at step {s} ({age:.1f}s silent)" for r, s, age in silent)
        return f"{who}; the driver was at step {step}: {type(error).__name__}: {str(error)[:200]}"
