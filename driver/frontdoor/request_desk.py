"""The front door's requests: who owns which request id, from `accepted` to `final` (docs/protocol.md, "Limits,
fairness and slow readers").

Every accepted submit becomes a ticket (an identity: a request id reused after its owner left is another ticket);
its outputs come back from the loop through the ticket's own sink, and those of a gone owner are dropped. An id
stays taken until the loop has let its request go. Only the front door's thread calls the desk, except `on_output`
(the loop thread)."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster import protocol as P
from cluster.errors import Code, LockstepError, QueueFull, RequestRejected
from cluster.outputs import FINISH_REASONS, GenerationOutput, RequestStatus, versions_between
from driver.engine.staleness import settle_policy
from cluster.samples import sample_ids
from driver.frontdoor.admission import Admission, Ticket
from driver.frontdoor.text_output import TextOutput

log = logging.getLogger("lockstep")

LOOP_GRACE_S = 5.0  # the loop may be silent for cpu_group_timeout plus this before the front door gives up on it


@dataclass
class ClientState:
    last_seen: float
    tickets: dict[str, Ticket] = field(default_factory=dict)  # its accepted, unanswered requests


class RequestDesk:
    def __init__(self, manager: Any, max_inflight_per_client: int, send: Callable[..., None],
                 send_once: Callable[[bytes, bytes], bool], wake: Callable[[], None], counters: dict[str, int],
                 tokenizer: Any = None):
        """`send(ident, kind, **fields)` queues a message; `send_once(ident, frame)` tries one send, no backlog;
        `wake()` wakes the front door's thread; `tokenizer` makes the text of the requests that want text."""
        self.manager, self.tokenizer, self.max_inflight_per_client = manager, tokenizer, max_inflight_per_client
        self.send, self.send_once, self.wake = send, send_once, wake
        self.counters = counters
        self.server_id = os.urandom(8).hex()  # new at each start: `accepted` and `pong` carry it (a restart shows)
        self.tickets: dict[str, Ticket] = {}  # every request id in use: queued, in the manager, or being cancelled
        self.clients: dict[bytes, ClientState] = {}
        self.admission = Admission()
        self.in_manager = 0  # tickets handed to manager.submit whose final has not come back
        self.in_manager_of: Counter[bytes] = Counter()  # the same, by client (a ticket's req.client: its ident)
        self.outputs: deque[tuple[Ticket, GenerationOutput]] = deque()
        self.loop_deadline_s = (manager.effective_config.cpu_group_timeout or 300.0) + LOOP_GRACE_S

    def client(self, ident: bytes) -> ClientState:
        """The client's record, refreshed: it just sent something."""
        c = self.clients.setdefault(ident, ClientState(0.0))
        c.last_seen = time.monotonic()
        return c

    def stats(self) -> dict[str, Any]:
        return {"clients": len(self.clients), "queued": len(self.admission), "in_manager": self.in_manager,
                "requests": len(self.tickets)}

    # -------------------------------------------------------------- in
    def submit(self, ident: bytes, client: ClientState, s: P.Submit, input_ids: list[int]) -> None:
        """Validate and queue a submit (ProtocolError if refused), then say `accepted`."""
        rid, mid, max_queue = s.request_id, s.mid, self.manager.config.max_queue_size
        if not self.loop_answers():
            raise P.ProtocolError(self.failure_code(), "the step loop is not answering; no new requests", mid, rid)
        taken = [i for i in sample_ids(rid, s.n) if i in self.tickets]
        if taken:
            raise P.ProtocolError(Code.DUPLICATE_REQUEST_ID, f"request id {taken[0]!r} is already in flight", mid, rid)
        if len(client.tickets) + s.n > self.max_inflight_per_client:
            raise P.ProtocolError(Code.CLIENT_LIMIT, f"this client has {len(client.tickets)} requests in flight "
                                  f"(max_inflight_per_client={self.max_inflight_per_client})", mid, rid)
        if max_queue and len(self.admission) >= max_queue:
            raise P.ProtocolError(Code.QUEUE_FULL, f"the queue is full (max_queue_size={max_queue})", mid, rid)
        try:
            req = self.manager.build_request(input_ids, rid, s.max_new_tokens, s.streaming, False, s.eos_token_id,
                                             strict_processors=True, resume_tokens=s.resume_tokens,
                                             resume_versions=s.resume_versions, resumes=s.resumes,
                                             priority=s.priority, top_logprobs=s.top_logprobs,
                                             max_weight_lag=s.max_weight_lag, stale_policy=s.stale_policy,
                                             num_return_sequences=s.n, prompt_logprobs=s.prompt_logprobs,
                                             logprobs_mode=s.logprobs_mode, speculative=s.speculative,
                                             **s.sampling)
            if s.stop:  # per-token outputs, so a stop string ends it at once (ticket.streaming: does the client
                for r in (req, *req.children):  # get them); text already sent is never taken back: no stale restart
                    r.streaming = True
                    settle_policy(r, explicit=s.stale_policy is not None)
        except RequestRejected as e:
            raise P.ProtocolError(e.code, e.message, mid, rid) from None
        ticket, *samples = [self._ticket(ident, s, r) for r in [req, *req.children]]  # n samples: a ticket each
        ticket.samples = samples
        for t in (ticket, *samples):
            self.tickets[t.rid] = client.tickets[t.rid] = t
        self.admission.put(ticket)  # the samples go to the manager with it
        self.counters["accepted"] += 1
        self.send(ident, P.ACCEPTED, mid=mid, request_id=rid, server=self.server_id)

    def _ticket(self, ident: bytes, s: P.Submit, req: Any) -> Ticket:
        """The ticket of one request (or sample) of a submit; a sample's outputs go to its own ticket."""
        req.client = ident  # the scheduler's turns go by connection (driver/engine/fair_queue.py)
        req.return_logprobs = req.return_logprobs or s.logprobs
        text = TextOutput.make(self.tokenizer, s.stop, s.resume_tokens) if s.wants_text else None
        # a resumed request's outputs start with the tokens its client already has: the stream goes on after them
        ticket = Ticket(req.request_id, ident, s.streaming, req, sent=req.resumed_tokens, text=text,
                        logprobs=s.logprobs)
        if req.child_index >= 0:
            req.sink = functools.partial(self.on_output, ticket)
        return ticket

    def admit(self) -> None:
        """Hand queued tickets to the manager, round-robin across clients, while its queue is short; past that, a
        client holding less than its share of that length in the manager (an equal part among the clients holding or
        queueing requests) still hands one in, so one client's flood does not keep another's request here."""
        batch, waiting = self.manager.effective_config.max_requests_per_batch, self.manager.engine.scheduler.waiting
        while self.admission:
            if self.in_manager < 2 * batch and len(waiting) < batch:
                ticket = self.admission.next()
            else:
                share = 2 * batch // len(self.in_manager_of.keys() | self.admission.queues.keys())
                ticket = self.admission.next_of(lambda client: self.in_manager_of[client] < share)
                if ticket is None:
                    return
            try:
                self.manager.submit(ticket.req, functools.partial(self.on_output, ticket))
            except QueueFull:
                self.admission.put_back(ticket)
                return
            except LockstepError as e:
                for t in (ticket, *ticket.samples):
                    self.fail(t, e.code, e.message)
                continue
            for t in (ticket, *ticket.samples):
                t.in_manager = not t.answered  # a sample cancelled while queued is not in the manager
                self.in_manager += t.in_manager
                self.in_manager_of[t.req.client] += t.in_manager

    def cancel(self, ident: bytes, client: ClientState, rid: str, mid: Any) -> None:
        ticket = client.tickets.get(rid)
        if ticket is None:
            raise P.ProtocolError(Code.UNKNOWN_REQUEST, f"no request {rid!r} of yours is in flight", mid, rid)
        self.send(ident, P.REPLY, mid=mid, data={"cancelled": rid})
        queued = self.admission.remove(ticket)
        for t in (ticket, *ticket.samples):  # a request's id cancels its samples too
            if t.in_manager:
                self.manager.cancel_request(t.rid)  # its CANCELLED final comes from the loop
            elif queued or (t.req.child_index >= 0 and not t.answered):  # not handed to the manager yet
                t.req.status, t.req.error = RequestStatus.CANCELLED, "cancelled"
                t.req.finish_reason = FINISH_REASONS[RequestStatus.CANCELLED]
                self.deliver(t, t.req.output())

    # -------------------------------------------------------------- out
    def on_output(self, ticket: Ticket, out: GenerationOutput) -> None:
        """A ticket's sink: the manager's loop thread calls it with every output of that request."""
        self.outputs.append((ticket, out))
        self.wake()

    def drain_outputs(self) -> None:
        while self.outputs:
            self.deliver(*self.outputs.popleft())

    def deliver(self, ticket: Ticket, out: GenerationOutput) -> None:
        """One output of a ticket, to its owner if it still has one."""
        finished = out.is_finished()
        if finished:
            if ticket.in_manager:
                ticket.in_manager = False
                self.in_manager -= 1
                self.in_manager_of[ticket.req.client] -= 1
                if not self.in_manager_of[ticket.req.client]:
                    del self.in_manager_of[ticket.req.client]
            if self.tickets.get(ticket.rid) is ticket:
                del self.tickets[ticket.rid]
        if ticket.answered or ticket.ident is None:
            return  # its owner is gone, or it was already answered: a stale output
        if ticket.text is not None and out.status != RequestStatus.FAILED and ticket.text.update(out) and not finished:
            # a stop string ended it: the loop's later outputs of it are dropped
            self.manager.cancel_request(ticket.rid, finish_reason="stop")  # the driver's metrics count a stop
            finished = True
        if not finished:
            if ticket.streaming:
                self._send_tokens(ticket, out)
            return
        self._settle(ticket)
        self.counters["finished"] += 1
        if out.status == RequestStatus.FAILED:
            self.send(ticket.ident, P.ERROR, request_id=ticket.rid, code=out.error_code or Code.INTERNAL,
                      message=out.error or "")
        else:
            self.send(ticket.ident, P.FINAL, output=out.to_dict())

    def _send_tokens(self, ticket: Ticket, out: GenerationOutput) -> None:
        """A streaming ticket's new tokens (with their text and logprobs when asked for)."""
        start, ticket.sent = ticket.sent, len(out.generated_tokens)
        extra: dict[str, Any] = {} if ticket.text is None else {"text": ticket.text.take_delta()}
        if ticket.logprobs:
            extra["logprobs"] = out.logprobs[start:ticket.sent]
        if out.top_logprobs is not None:
            extra["top_logprobs"] = out.top_logprobs[start:ticket.sent]
        self.send(ticket.ident, P.TOKENS, request_id=ticket.rid, tokens=out.generated_tokens[start:], index=start,
                  versions=[list(p) for p in versions_between(out.weight_versions, start, ticket.sent)], **extra)

    def _settle(self, ticket: Ticket) -> None:
        """The ticket is answered: its owner no longer counts it."""
        ticket.answered = True
        client = self.clients.get(ticket.ident)
        if client is not None and client.tickets.get(ticket.rid) is ticket:
            del client.tickets[ticket.rid]

    def fail(self, ticket: Ticket, code: str, message: str) -> None:
        """End a ticket with an `error` from the front door itself (the loop cannot answer it)."""
        if not ticket.in_manager and self.tickets.get(ticket.rid) is ticket:
            del self.tickets[ticket.rid]  # a ticket in the manager keeps its id until the loop lets it go
        if ticket.answered or ticket.ident is None:
            return
        self._settle(ticket)
        self.send(ticket.ident, P.ERROR, request_id=ticket.rid, code=code, message=message)

    # -------------------------------------------------------------- clients that leave
    def drop_client(self, ident: bytes, counter: str, last_code: str | None = None) -> int:
        """Cancel every request of a gone client; `last_code`: tell it why once, per request. Returns how many."""
        client = self.clients.pop(ident, None)
        if client is None:
            return 0
        for queued in self.admission.drop_client(ident):
            for ticket in (queued, *queued.samples):
                if self.tickets.get(ticket.rid) is ticket:
                    del self.tickets[ticket.rid]
        for ticket in client.tickets.values():
            if ticket.in_manager:
                self.manager.cancel_request(ticket.rid)  # the id stays taken until its CANCELLED final
            if last_code is not None:
                self.send_once(ident, P.encode(P.ERROR, request_id=ticket.rid, code=last_code,
                                               message="the client stopped reading its replies"))
            ticket.answered, ticket.ident = True, None
        self.counters[counter] += len(client.tickets)
        return len(client.tickets)

    def silent_clients(self, timeout_s: float, pause_owner: bytes | None) -> list[bytes]:
        """Clients silent for timeout_s that hold requests or the pause (the others are just forgotten)."""
        limit = time.monotonic() - timeout_s
        for ident in [i for i, c in self.clients.items() if c.last_seen < limit and not c.tickets and i != pause_owner]:
            del self.clients[ident]
        return [i for i, c in self.clients.items() if c.last_seen < limit]

    # -------------------------------------------------------------- a loop that does not answer
    def loop_answers(self) -> bool:
        return self.manager.loop_answers(self.loop_deadline_s)

    def failure_code(self) -> str:
        m = self.manager
        if m.failure_code:  # the loop failed and said why (its thread may still be ending its requests)
            return m.failure_code
        if m.is_running() and not m.closed:
            return Code.DRIVER_FAILED  # alive but stuck past its deadline
        if m.loop_error is None and m.failure is None:
            return Code.STOPPED
        return Code.DRIVER_FAILED

    def check_loop(self) -> None:
        """Fail every outstanding request here if the loop died or has not come round within its deadline."""
        answers = self.loop_answers()
        self.drain_outputs()  # what a dying loop emitted comes first, with its own codes
        if answers:
            return
        self.admission = Admission()  # forget the queued tickets: they are in self.tickets too, failed below
        owed = [t for t in self.tickets.values() if not t.answered and t.ident is not None]
        code, m = self.failure_code(), self.manager
        message = (m.failure or f"the driver's step loop has not answered for "
                   f"{time.monotonic() - m.loop_beat:.1f}s (deadline {self.loop_deadline_s:.0f}s)")
        if owed:
            log.error("frontend: failing %d request(s) with %s: %s", len(owed), code, message)
        for ticket in list(self.tickets.values()):
            if ticket.in_manager and not ticket.answered:
                m.cancel_request(ticket.rid)
            self.fail(ticket, code, message)
        self.counters["loop_deadline_fails"] += len(owed)
