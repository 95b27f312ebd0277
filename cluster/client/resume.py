"""The client's side of crash recovery: it resubmits the requests the server lost, token-exactly.

A lost request comes here from the I/O thread (`IOThread.lose`). One thread per client waits until the server at
the same address answers `health` ok, then resubmits each request with the same id and parameters plus the
tokens delivered (`resume_tokens`, their weight versions, the resume count); the server continues from the next
token index. A request not resumed within `resume_timeout_s` or `max_resumes`, refused for good, or waiting when
the client closes ends with RequestLost, saying why and how many tokens were delivered (docs/recovery.md).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from cluster import protocol as P
from cluster.errors import ClientError, Code, RequestLost
from cluster.client.pending import PendingRequest, settle

log = logging.getLogger("lockstep")

HEALTH_WAIT_S = 2.0  # one health call's wait; the next follows after RETRY_S
RETRY_S = 0.25
IDLE_EXIT_S = 30.0  # the thread ends after this long with nothing to resume
SUBMIT_WAIT_S = 10.0  # how long a resubmit waits for `accepted` before it is tried again
# a resubmit refused with one of these is tried again (the old server is still going down, or still holds the id)
RETRY_CODES = frozenset({Code.RANK_FAILED, Code.DRIVER_FAILED, Code.STOPPED, Code.SERVER_GONE, Code.CLIENT_FAILED,
                         Code.DUPLICATE_REQUEST_ID, Code.QUEUE_FULL, Code.CLIENT_LIMIT, Code.WEIGHTS_DIVERGED})


class ClientDropped(RuntimeError):
    """The Client this resumer served was garbage-collected (its caller dropped it)."""


@dataclass(eq=False)
class Lost:
    req: PendingRequest
    cause: ClientError  # what ended it on the server (or the connection)
    deadline: float  # give up at this time.monotonic()
    again: bool = False  # lost again while a resubmit of it was on its way


class Resumer:
    """Resubmits a client's lost requests (`client` is the Client whose I/O thread lost them)."""

    def __init__(self, client: Any, max_resumes: int, resume_timeout_s: float):
        # weakly: the client's I/O thread holds `lost`, so a strong reference would keep a dropped client alive
        # for ever; its finalizer closes the I/O thread, and this then gives up
        self._client = weakref.ref(client)
        self.address = client.address
        self.max_resumes, self.resume_timeout_s = max_resumes, resume_timeout_s
        self.cond = threading.Condition()
        self.waiting: dict[PendingRequest, Lost] = {}  # every request waiting for its resume, once
        self.closed = False
        self.thread: threading.Thread | None = None

    def lost(self, req: PendingRequest, cause: ClientError) -> None:
        """The server lost `req` (any thread): resumed, or RequestLost at once (max_resumes reached, or closed)."""
        with self.cond:
            if (item := self.waiting.get(req)) is not None:  # a resubmit is on its way: its round sees this loss
                item.again = True
                return
            if req.resumes < self.max_resumes and not self.closed:
                self.waiting[req] = Lost(req, cause, time.monotonic() + self.resume_timeout_s)
                if self.thread is None:
                    self.thread = threading.Thread(target=self._run, name="lockstep-resume", daemon=True)
                    self.thread.start()
                self.cond.notify_all()
                return
            reason = RequestLost.CLIENT_CLOSED if self.closed else RequestLost.MAX_RESUMES
        self._give_up(Lost(req, cause, 0.0), reason)

    def close(self) -> None:
        """The client gives up: every request still waiting ends with RequestLost (client_closed)."""
        with self.cond:
            self.closed = True
            left, self.waiting = list(self.waiting.values()), {}
            self.cond.notify_all()
        for item in left:
            self._give_up(item, RequestLost.CLIENT_CLOSED)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            with self.cond:
                if not self.waiting and not self.closed:
                    self.cond.wait(IDLE_EXIT_S)
                if self.closed or not self.waiting:
                    self.thread = None  # idle (or closed): a later loss starts a new thread
                    return
                batch = list(self.waiting.values())
            try:
                self._round(batch)
            except Exception as e:  # never leave a request waiting for a thread that died
                log.exception("lockstep client: resuming failed")
                for item in batch:
                    self._give_up(item, RequestLost.REFUSED, f"the resume failed: {type(e).__name__}: {e}")
            now = time.monotonic()
            with self.cond:
                late = [i for i in self.waiting.values() if i.deadline <= now]
            for item in late:
                self._give_up(item, RequestLost.NO_SERVER, f"no healthy server at {self.address} within "
                                                           f"resume_timeout_s={self.resume_timeout_s:g}")
            with self.cond:
                if self.waiting and not self.closed:
                    self.cond.wait(RETRY_S)

    @property
    def client(self) -> Any:
        if (client := self._client()) is None:
            raise ClientDropped(f"the client of {self.address} was dropped")
        return client

    def _round(self, batch: list[Lost]) -> None:
        """One try: if the server is healthy, resubmit every request of `batch`."""
        if self._client() is None:  # nobody is left to resume for
            for item in batch:
                self._give_up(item, RequestLost.CLIENT_CLOSED)
            return
        for item in batch:
            if item.req.final.done() or item.req.dropped:  # ended meanwhile, or its caller left
                self._forget(item)
        batch = [i for i in batch if not (i.req.final.done() or i.req.dropped)]
        if not batch or not self._healthy(min(HEALTH_WAIT_S, max(i.deadline for i in batch) - time.monotonic())):
            return
        for item in batch:
            item.again = False
        sent = [(item, self._resubmit(item.req)) for item in batch]
        for item, fut in sent:
            try:
                fut.result(SUBMIT_WAIT_S)
            except FutureTimeout:
                continue
            except ClientError as e:
                if e.code not in RETRY_CODES:
                    self._give_up(item, RequestLost.REFUSED, f"the server refused the resume: {e}")
                continue
            with self.cond:
                if not item.again:  # resumed; a loss from now on comes through `lost` again
                    self.waiting.pop(item.req, None)
                    continue
                item.again = False
            if item.req.resumes >= self.max_resumes:
                self._give_up(item, RequestLost.MAX_RESUMES)

    def _forget(self, item: Lost) -> None:
        with self.cond:
            if self.waiting.get(item.req) is item:
                del self.waiting[item.req]

    def _healthy(self, wait: float) -> bool:
        if wait <= 0:
            return False
        try:
            data = self.client.data_future(P.HEALTH).result(wait)
        except (FutureTimeout, ClientError):
            return False
        return isinstance(data, dict) and data.get("ok") is True

    def _resubmit(self, req: PendingRequest) -> Future:
        """Send the resuming submit through the client's current I/O thread; the future resolves on `accepted`."""
        io = self.client.io
        try:
            io.track(req, again=True)
        except ClientError as e:
            settle(sent := Future(), error=e)
            return sent
        sent = io.call(P.SUBMIT, **req.resume_fields())

        def on_reply(f: Future) -> None:  # on the I/O thread, before any token of the resumed request
            if not f.cancelled() and f.exception() is None:
                req.resumes += 1  # accepted: its outputs from now on count this resume
            else:  # refused: not outstanding on the server, still waiting for a resume
                io.set_waiting(req)

        sent.add_done_callback(on_reply)
        return sent

    def _give_up(self, item: Lost, reason: str, why: str | None = None) -> None:
        self._forget(item)
        item.req.end(lost_error(item.req, item.cause, reason, why))


def lost_error(req: PendingRequest, cause: ClientError, reason: str, why: str | None = None) -> RequestLost:
    """The RequestLost that ends `req`, lost for `cause`, given up for `reason`, `why` added to the message."""
    message = cause.message if why is None else f"{cause.message}; {why}"
    return RequestLost(cause.code, message, req.request_id, reason, len(req.tokens), req.resumes)
