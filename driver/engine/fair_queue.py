"""The scheduler's waiting queue: which waiting request is admitted next.

The order (docs/architecture.md, "Fair scheduling"):

1. strict priority: a lower `priority` number first (vLLM's meaning; the default is 0);
2. within one priority, requests that were preempted come back first (most recently preempted last, as a stack
   pushed oldest-victim-last), so a preempted request is not overtaken by new ones of its own priority; a running
   request that gave way to another client's (fair_share.py) goes back to the head of its own client's queue
   instead, its client counted as just served (`requeue`);
3. then the clients of that priority in turn: the client served least recently goes next, and a client that had
   nothing waiting counts as never served, so one client's 3,000 waiting requests delay another client's new
   request by nothing (it is admitted at the next step with room); clients that are equally fresh go by the
   arrival of their oldest waiting request;
4. first come, first served within one client.

Every decision reads only the queue's own counters (arrival numbers and service stamps), never a clock, so the
same arrivals give the same order on any run. Requests from the manager's Python API share one client, LOCAL_CLIENT.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Hashable, Iterator
from itertools import zip_longest

from driver.engine.request import Request

NEVER = -1  # the service stamp of a client with nothing waiting: it goes before every client being served


class _Level:
    """The waiting requests of one priority: preempted ones first, then the clients' queues in turn."""

    def __init__(self) -> None:
        self.preempted: deque[Request] = deque()
        self.clients: dict[Hashable, deque[Request]] = {}
        self.stamps: dict[Hashable, int] = {}  # client -> when it was last served (NEVER: not while waiting)
        self.turns: list[tuple[int, int, Hashable]] = []  # heap of (stamp, arrival of its oldest, client)

    def __len__(self) -> int:
        return len(self.preempted) + sum(map(len, self.clients.values()))

    def join(self, client: Hashable, arrival: int) -> None:
        """A client with a new oldest request takes its turn in the heap (an older entry of it goes stale)."""
        stamp = self.stamps.setdefault(client, NEVER)
        heapq.heappush(self.turns, (stamp, arrival, client))

    def head_client(self) -> Hashable:
        """The client whose turn it is (stale heap entries are dropped on the way)."""
        while True:
            stamp, arrival, client = self.turns[0]
            q = self.clients.get(client)
            if q and self.stamps[client] == stamp and q[0].arrival == arrival:
                return client
            heapq.heappop(self.turns)

    def __iter__(self) -> Iterator[Request]:
        yield from self.preempted
        order = sorted(self.clients, key=lambda c: (self.stamps[c], self.clients[c][0].arrival))
        for row in zip_longest(*(self.clients[c] for c in order)):
            yield from (r for r in row if r is not None)


class FairQueue:
    """Waiting requests in admission order: strict priority, then preempted first, then clients round-robin
    (least recently served first), then FCFS. `peek`/`pop` give the next one; `push_front` returns a preempted
    request, `requeue` one that gave way; `remove` takes out a cancelled one."""

    def __init__(self) -> None:
        self.levels: dict[int, _Level] = {}
        self.priorities: list[int] = []  # sorted keys of `levels`
        self.members: set[Request] = set()
        self.arrivals = 0  # the next arrival number
        self.served = 0  # the next service stamp

    def __len__(self) -> int:
        return len(self.members)

    def __bool__(self) -> bool:
        return bool(self.members)

    def __contains__(self, req: Request) -> bool:
        return req in self.members

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in the order the queue would admit them if none arrived meanwhile (near enough:
        the clients' turns as they stand)."""
        for p in self.priorities:
            yield from self.levels[p]

    def _level(self, priority: int) -> _Level:
        level = self.levels.get(priority)
        if level is None:
            self.levels[priority] = level = _Level()
            bisect.insort(self.priorities, priority)
        return level

    def append(self, req: Request) -> None:
        """A new request: it joins the end of its client's queue at its priority (its arrival number set here)."""
        req.arrival = self.arrivals
        self.arrivals += 1
        level = self._level(req.priority)
        q = level.clients.get(req.client)
        if q is None:
            level.clients[req.client] = q = deque()
        q.append(req)
        if len(q) == 1:
            level.join(req.client, req.arrival)
        self.members.add(req)

    def push_front(self, req: Request) -> None:
        """A preempted request: it goes before every new request of its priority (and before earlier victims)."""
        self._level(req.priority).preempted.appendleft(req)
        self.members.add(req)

    def requeue(self, req: Request) -> None:
        """A running request that gave way to another client's (fair_share.gives_way): it goes back to the head of
        its own client's queue, and its client counts as just served, so it does not take the row back at once."""
        level = self._level(req.priority)
        q = level.clients.setdefault(req.client, deque())
        q.appendleft(req)
        level.stamps[req.client] = self.served
        self.served += 1
        level.join(req.client, req.arrival)
        self.members.add(req)

    def peek(self) -> Request:
        """The next request to admit (the queue must not be empty)."""
        level = self.levels[self.priorities[0]]
        if level.preempted:
            return level.preempted[0]
        return level.clients[level.head_client()][0]

    def pop(self) -> Request:
        """Take the next request out; its client's turn passes (it is now the most recently served)."""
        priority = self.priorities[0]
        level = self.levels[priority]
        if level.preempted:
            req = level.preempted.popleft()
        else:
            client = level.head_client()
            heapq.heappop(level.turns)
            q = level.clients[client]
            req = q.popleft()
            level.stamps[client] = self.served
            self.served += 1
            if q:
                level.join(client, q[0].arrival)
            else:
                self._forget(level, client)
        self.members.discard(req)
        self._drop_if_empty(priority, level)
        return req

    def remove(self, req: Request) -> None:
        """Take a waiting request out wherever it stands (a cancel, a failure)."""
        self.members.remove(req)
        level = self.levels[req.priority]
        if req in level.preempted:
            level.preempted.remove(req)
        else:
            q = level.clients[req.client]
            was_head = q[0] is req
            q.remove(req)
            if not q:
                self._forget(level, req.client)
            elif was_head:
                level.join(req.client, q[0].arrival)
        self._drop_if_empty(req.priority, level)

    @staticmethod
    def _forget(level: _Level, client: Hashable) -> None:
        """A client with nothing left waiting: it leaves the turns (its heap entries go stale) and, when it comes
        back, counts as never served."""
        del level.clients[client]
        del level.stamps[client]

    def _drop_if_empty(self, priority: int, level: _Level) -> None:
        if not level.preempted and not level.clients:
            del self.levels[priority]
            self.priorities.remove(priority)
