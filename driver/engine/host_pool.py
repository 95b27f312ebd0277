"""The driver's accounting of the host KV pool (`cpu_offload_space`; docs/architecture.md, "KV offload"): which
host slots are free, which request holds which, and the page copies the next plan must carry. Slots a swap-in read
are not handed out again until that plan was taken, so a later swap-out in the same plan never overwrites them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from driver.engine.request import Request


@dataclass
class OffloadStats:
    swapped_out_requests: int = 0
    swapped_out_pages: int = 0
    swapped_in_requests: int = 0
    swapped_in_pages: int = 0
    recomputed_tokens: int = 0  # tokens whose KV was dropped at a preemption and computed again


class HostPool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free: deque[int] = deque(range(num_slots))
        self.held: dict[Request, list[int]] = {}  # swapped-out request -> its host slots, page order
        self.read_this_plan: list[int] = []  # slots swap-ins of the pending plan still read
        # copies decided since the last plan that ran a forward, in the order the ranks must do them
        self.outs: list[tuple[int, int]] = []  # (device page, host slot)
        self.ins: list[tuple[int, int]] = []  # (host slot, device page)
        self.stats = OffloadStats()

    def holds(self, req: Request) -> bool:
        return req in self.held

    def swap_out(self, req: Request, pages: list[int]) -> bool:
        """Copy `pages` (the request's computed pages, in order) to host slots; False if the pool is short."""
        if not pages or len(pages) > len(self.free):
            return False
        slots = [self.free.popleft() for _ in pages]
        self.held[req] = slots
        self.outs.extend(zip(pages, slots))
        self.stats.swapped_out_requests += 1
        self.stats.swapped_out_pages += len(pages)
        return True

    def swap_in(self, req: Request, pages: list[int], cached: int = 0) -> None:
        """Copy the request's host slots into `pages`, freeing them; the first `cached` pages hold it already."""
        slots = self.held.pop(req)
        self.ins.extend(zip(slots[cached:], pages[cached:]))
        self.read_this_plan.extend(slots)
        self.stats.swapped_in_requests += 1
        self.stats.swapped_in_pages += len(slots) - cached

    def drop(self, req: Request) -> None:
        """Forget the request's host copy (it finished, was cancelled, or must recompute after all)."""
        self.free.extend(self.held.pop(req, []))

    def take(self) -> tuple[np.ndarray, np.ndarray]:
        """The copies a plan that runs a forward carries: ([n, 2] swap-outs, [m, 2] swap-ins)."""
        outs, ins, self.outs, self.ins = self.outs, self.ins, [], []
        self.free.extend(self.read_this_plan)
        self.read_this_plan = []
        return np.asarray(outs, np.int32).reshape(-1, 2), np.asarray(ins, np.int32).reshape(-1, 2)
