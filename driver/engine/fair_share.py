"""Clients' shares of a step on rank 0: how the scheduler splits a step's rows and tokens among clients, which running
request gives way to another client's waiting one, and which one is preempted when pages run out
(docs/architecture.md, "Fair scheduling").

A client's share of something (the batch's rows, the step's tokens, the cache's pages) is an equal part of it among
the clients that want some. Every decision reads only the requests' clients, priorities and counts, never a clock,
so the same requests give the same plans on any run."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from operator import attrgetter

import numpy as np

from driver.engine.request import Request


def client_codes(clients: Sequence[Hashable]) -> np.ndarray:
    """Each client as a small integer (0, 1, ... in order of first appearance), one per entry."""
    index = {c: i for i, c in enumerate(dict.fromkeys(clients))}
    if len(index) <= 1:
        return np.zeros(len(clients), np.int64)
    return np.fromiter(map(index.__getitem__, clients), np.int64, len(clients))


def fair_split(groups: np.ndarray, want: np.ndarray, total: int) -> np.ndarray:
    """How much of `total` each row gets, rows in service order (`groups`: small integers, `client_codes`): first
    each group's rows in order, up to the group's equal share (`total // groups`), then what is left to every row in
    order. Nothing is left over while rows want more; each group gets its share or all it wants; with one group it is
    plain first come, first served."""
    if total <= 0 or not len(want):
        return np.zeros(len(want), np.int64)
    if total >= want.sum():
        return want.copy()
    count = np.bincount(groups)
    if np.count_nonzero(count) == 1:
        return _upto(want, total)
    share = total // np.count_nonzero(count)
    order = np.argsort(groups, kind="stable")
    w = want[order]
    before = np.cumsum(w) - w  # wanted ahead of each row, all groups
    starts = np.flatnonzero(np.diff(groups[order], prepend=-1))  # each group's first row
    ahead = before - np.repeat(before[starts], np.diff(starts, append=len(w)))  # wanted ahead within its group
    got = np.empty(len(want), np.int64)
    got[order] = np.minimum(np.maximum(share - ahead, 0), w)
    return got + _upto(want - got, total - int(got.sum()))


def _upto(want: np.ndarray, total: int) -> np.ndarray:
    """First come, first served: each row what it wants of what the rows before it left of `total`."""
    return np.minimum(np.maximum(total - (np.cumsum(want) - want), 0), want)


def held_by_client(running: Sequence[Request], weight: Callable[[Request], int] | None = None) -> Counter:
    """What each client's running requests hold: how many (weight None), or the sum of `weight`."""
    if weight is None:
        return Counter(map(attrgetter("client"), running))
    held: Counter = Counter()
    for r in running:
        held[r.client] += weight(r)
    return held


def victim(running: Sequence[Request], candidates: Sequence[Request]) -> Request:
    """Which of `candidates` (running requests, in running order) is preempted when pages run out: the lowest
    priority (highest number), then the client with the most running requests, then that client's newest."""
    return _lowest(candidates, held_by_client(running))


def gives_way(running: Sequence[Request], head: Request, total: int,
              weight: Callable[[Request], int] | None = None) -> Request | None:
    """The running request that gives way to the waiting `head` when all of `total` (rows, or pages: `weight`, what a
    request holds of them) is held: only when head's client holds less than its equal share (among the clients running
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
