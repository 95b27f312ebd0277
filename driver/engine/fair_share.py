"""Clients' shares of a step on rank 0: how the scheduler splits a step's rows and tokens among clients, which running
request gives way to another client's waiting one, and which one is preempted when pages run out
(docs/architecture.md, "Fair scheduling").

A client's share of something (the batch's rows, the step's tokens, the cache's pages) is an equal part of it among
the clients that want some. Every decision reads only the requests' clients, priorities and counts, never a clock,
so the same requests give the same plans on any run."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from driver.engine.request import Request


def client_codes(clients: Sequence[Hashable]) -> np.ndarray:
    """Each client as a small integer (0, 1, ... in order of first appearance), one per entry."""
    index: dict[Hashable, int] = {}
    return np.fromiter((index.setdefault(c, len(index)) for c in clients), np.int64, len(clients))


def fair_split(groups: np.ndarray, want: np.ndarray, total: int) -> np.ndarray:
    """How much of `total` each row gets, rows in service order: first each group's rows in order, up to the group's
    equal share (`total // groups`), then what is left to every row in order. Nothing is left over while rows want
    more; each group gets its share or all it wants; with one group it is plain first come, first served."""
    got = np.zeros(len(want), np.int64)
    if total <= 0 or not len(want):
        return got
    share = total // (int(groups.max()) + 1)
    order = np.argsort(groups, kind="stable")
    w, g = want[order], groups[order]
    before = np.cumsum(w) - w  # wanted ahead of each row, all groups
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])  # each group's first row
    ahead = before - np.repeat(before[starts], np.diff(np.r_[starts, len(g)]))  # wanted ahead within its group
    got[order] = np.clip(share - ahead, 0, w)
    more = want - got
    left = total - int(got.sum())
    return got + np.clip(left - (np.cumsum(more) - more), 0, more)


def held_by_client(running: Sequence[Request], weight: Callable[[Request], int]) -> Counter:
    held: Counter = Counter()
    for r in running:
        held[r.client] += weight(r)
    return held


def victim(running: Sequence[Request], candidates: Sequence[Request]) -> Request:
    """Which of `candidates` (running requests, in running order) is preempted when pages run out: the lowest
    priority (highest number), then the client with the most running requests, then that client's newest."""
    return _lowest(candidates, held_by_client(running, lambda r: 1))


def gives_way(running: Sequence[Request], head: Request, total: int,
              weight: Callable[[Request], int]) -> Request | None:
    """The running request that gives way to the waiting `head` when all of `total` (rows, pages; `weight`: what a
    request holds of it) is held: only when head's client holds less than its equal share (among the clients running
    and head's), from a client that holds more, of head's priority or lower; the lowest priority, then the client
    holding most, then its newest. None when nobody should give way."""
    held = held_by_client(running, weight)
    share = total // len(held.keys() | {head.client})
    if held[head.client] >= share:
        return None
    over = [r for r in running if r.client != head.client and r.priority >= head.priority and held[r.client] > share]
    if not over:
        return None
    return _lowest(over, held)


def _lowest(reqs: Sequence[Request], held: Counter) -> Request:
    """The lowest priority (highest number), then the client holding most, then the last (the newest)."""
    return reqs[max(range(len(reqs)), key=lambda i: (reqs[i].priority, held[reqs[i].client], i))]
