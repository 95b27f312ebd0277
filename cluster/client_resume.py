"""The client's side of crash recovery: it resubmits the requests the server lost, token-exactly.

When a request ends with `rank_failed` or `driver_failed`, or the connection to the server is lost, the I/O
thread hands it here (cluster/client_io.py `lose`) instead of failing it. One thread per client waits until
the server at the same address answers `health` with ok (a restarted group comes back there), then resubmits
each request with the same id and parameters plus the tokens it already delivered (`resume_tokens`, their
weight versions, the resume count). The server continues from the next token index, so greedy and seeded
sampling give the uninterrupted answer, and streams go on without a repeated or a missing token.

The wait is bounded: a request not resumed within `resume_timeout_s` of its loss, one lost again after
`max_resumes` resumes, one whose resume the server refuses for good, or one still waiting when the client
closes ends with RequestLost, which says why and how many tokens were delivered. docs/recovery.md.
Torch-free: clients import it.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from cluster import protocol as P
from cluster.errors import ClientError, Code, RequestLost
from cluster.pending_request import PendingRequest

log = logging.getLogger("lockstep")

HEALTH_WAIT_S = 2.0  # one health call's wait; the next follows after RETRY_S
RETRY_S = 0.25
IDLE_EXIT_S = 30.0  # the thread ends after this long with nothing to resume
SUBMIT_WAIT_S = 10.0  # how long a resubmit waits for `accepted` before it is tried again
# a resubmit refused with one of these is tried again (the old server is still going down, or still holds the id)
RETRY_CODES = frozenset({Code.RANK_FAILED, Code.DRIVER_FAILED, Code.STOPPED, Code.SERVER_GONE, Code.CLIENT_FAILED,
                         Code.DUPLICATE_REQUEST_ID, Code.QUEUE_FULL, Code.CLIENT_LIMIT, Code.WEIGHTS_DIVERGED})


@dataclass
class Lost:
    req: PendingRequest
    cause: ClientError  # what ended it on the server (or the connection)
    deadline: float  # give up at this time.monotonic()


class Resumer:
    """Resubmits a client's lost requests (`client` is the Client whose I/O thread lost them)."""

    def __init__(self, client: Any, max_resumes: int, resume_timeout_s: float):
        self.client = client
        self.max_resumes, self.resume_timeout_s = max_resumes, resume_timeout_s
        self.cond = threading.Condition()
        self.waiting: list[Lost] = []
        self.closed = False
        self.thread: threading.Thread | None = None
        self.resumed = 0  # resumes the server accepted, over this client's life

    def lost(self, req: PendingRequest, cause: ClientError) -> None:
        """The server lost `req` (any thread; the I/O thread calls it). It is resumed, or ended with
        RequestLost at once when it already had max_resumes resumes or the client is closed."""
        if req.resumes >= self.max_resumes:
            self._give_up(Lost(req, cause, 0.0), RequestLost.MAX_RESUMES)
            return
        with self.cond:
            if not self.closed:
                self.waiting.append(Lost(req, cause, time.monotonic() + self.resume_timeout_s))
                if self.thread is None:
                    self.thread = threading.Thread(target=self._run, name="lockstep-resume", daemon=True)
                    self.thread.start()
                self.cond.notify_all()
                return
        self._give_up(Lost(req, cause, 0.0), RequestLost.CLIENT_CLOSED)

    def close(self) -> None:
        """The client gives up: every request still waiting ends with RequestLost (client_closed)."""
        with self.cond:
            self.closed = True
            left, self.waiting = self.waiting, []
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
                batch, self.waiting = self.waiting, []
            try:
                batch = self._round(batch)
            except Exception as e:  # never leave a request waiting for a thread that died
                log.exception("lockstep client: resuming failed")
                for item in batch:
                    self._give_up(item, RequestLost.REFUSED, f"the resume failed: {type(e).__name__}: {e}")
                batch = []
            now = time.monotonic()
            for item in [i for i in batch if i.deadline <= now]:
                self._give_up(item, RequestLost.NO_SERVER, f"no healthy server at {self.client.address} within "
                                                           f"resume_timeout_s={self.resume_timeout_s:g}")
            with self.cond:
                self.waiting = [i for i in batch if i.deadline > now] + self.waiting
                if self.waiting and not self.closed:
                    self.cond.wait(RETRY_S)

    def _round(self, batch: list[Lost]) -> list[Lost]:
        """One try: if the server is healthy, resubmit every request of `batch`; those still waiting."""
        batch = [i for i in batch if not (i.req.final.done() or i.req.dropped)]  # ended, or its caller left
        if not batch or not self._healthy(min(HEALTH_WAIT_S, max(i.deadline for i in batch) - time.monotonic())):
            return batch
        sent = [(item, self._resubmit(item.req)) for item in batch]
        left = []
        for item, fut in sent:
            try:
                fut.result(SUBMIT_WAIT_S)
            except FutureTimeout:
                left.append(item)
            except ClientError as e:
                if e.code in RETRY_CODES:
                    left.append(item)
                else:
                    self._give_up(item, RequestLost.REFUSED, f"the server refused the resume: {e}")
            else:
                item.req.resumes += 1
                self.resumed += 1
        return left

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
            io.retrack(req)
        except ClientError as e:
            fut: Future = Future()
            fut.set_exception(e)
            return fut
        sent = io.call(P.SUBMIT, **req.resume_fields())

        def on_reply(f: Future) -> None:  # refused: not outstanding on the server, still waiting for a resume
            if not f.cancelled() and f.exception() is not None:
                io.set_waiting(req)

        sent.add_done_callback(on_reply)
        return sent

    def _give_up(self, item: Lost, reason: str, why: str | None = None) -> None:
        req, cause = item.req, item.cause
        message = cause.message if why is None else f"{cause.message}; {why}"
        req.end(RequestLost(cause.code, message, req.request_id, reason, len(req.tokens), req.resumes))
