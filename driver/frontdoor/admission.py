"""Fair admission at the front door: accepted submits wait in one queue per client and go to the manager one client
at a time, round-robin, while the manager's own queue is short; one client's 100,000 submits delay a client that
sent one by at most one request of each other client."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(eq=False)  # identity: a reused request id is another ticket
class Ticket:
    """A request the front door accepted, from its `accepted` to its `final` (or `error`)."""

    rid: str
    ident: bytes | None  # the owning client; None once it is gone (its outputs are then dropped)
    streaming: bool
    req: Any  # driver.engine.request.Request, built and validated
    sent: int = 0  # tokens already streamed
    in_manager: bool = False  # handed to manager.submit; its final will come from the loop
    answered: bool = False  # its final or error went out (or its owner is gone): later outputs are dropped
    text: Any = None  # driver.frontdoor.text_output.TextOutput when its text is on (stop strings, text outputs)
    logprobs: bool = False  # streamed `tokens` carry the tokens' logprobs
    samples: list["Ticket"] = field(default_factory=list)  # n samples: the tickets of its children (cluster/samples.py)


class Admission:
    """Fair admission: tickets wait in one queue per client and go to the manager round-robin, so one client's
    100,000 submits delay another's by at most one each."""

    def __init__(self) -> None:
        self.queues: OrderedDict[bytes, deque[Ticket]] = OrderedDict()
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def put(self, ticket: Ticket) -> None:
        assert ticket.ident is not None
        self.queues.setdefault(ticket.ident, deque()).append(ticket)
        self.size += 1

    def put_back(self, ticket: Ticket) -> None:
        """Return the ticket `next()` gave (the manager could not take it now) to the head of its queue."""
        q = self.queues.get(ticket.ident)
        if q is None:
            self.queues[ticket.ident] = q = deque()
            self.queues.move_to_end(ticket.ident, last=False)
        q.appendleft(ticket)
        self.size += 1

    def next(self) -> Ticket:
        """The head of the next client's queue, round-robin (call it only when some ticket is queued)."""
        ident, q = next(iter(self.queues.items()))
        ticket = q.popleft()
        self.size -= 1
        if q:
            self.queues.move_to_end(ident)
        else:
            del self.queues[ident]
        return ticket

    def next_of(self, allowed: Callable[[bytes], bool]) -> Ticket | None:
        """The head of the next client's queue that `allowed(client)`, round-robin as `next`; None if none is."""
        for ident in self.queues:
            if allowed(ident):
                self.queues.move_to_end(ident, last=False)
                return self.next()
        return None

    def remove(self, ticket: Ticket) -> bool:
        """Take a queued ticket out (a cancel); False if it is not queued."""
        q = self.queues.get(ticket.ident)
        if q is None or ticket not in q:
            return False
        q.remove(ticket)
        self.size -= 1
        if not q:
            del self.queues[ticket.ident]
        return True

    def drop_client(self, ident: bytes) -> list[Ticket]:
        """Every queued ticket of a client that is gone."""
        q = self.queues.pop(ident, deque())
        self.size -= len(q)
        return list(q)
