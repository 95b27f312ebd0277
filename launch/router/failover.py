"""The router's failover: a request a replica lost is resumed on another replica, token-exactly.

A replica's client hands a lost request here (`lost`, its `on_lost`). One thread resubmits it as the client's
resume does (cluster/client/resume.py, docs/recovery.md) to a healthy replica, another one than the one that lost it
when there is one. A request not resumed within `resume_timeout_s`, or lost more than `max_resumes` times, ends
with RequestLost. Torch-free."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from cluster.client.resume import RETRY_CODES, lost_error
from cluster.errors import ClientError, Code, RequestLost
from cluster.client.pending import PendingRequest
from launch.router.replica_pool import Replica, ReplicaPool

log = logging.getLogger("lockstep")

WAIT_S = 0.5  # a round's wait for a healthy replica


@dataclass(eq=False)
class Lost:
    origin: int  # the replica that lost it
    req: PendingRequest
    cause: ClientError
    deadline: float  # time.monotonic() to give up at


class Failover:
    """`on_moved(request_id, new_req, replica)`: it goes on there; `on_failed(request_id, error)`: it ended. Both run
    on the failover thread or a client's I/O thread."""

    def __init__(self, pool: ReplicaPool, on_moved: Callable[[str, PendingRequest, Replica], None],
                 on_failed: Callable[[str, BaseException], None], max_resumes: int = 3,
                 resume_timeout_s: float = 60.0):
        self.pool, self.on_moved, self.on_failed = pool, on_moved, on_failed
        self.max_resumes, self.resume_timeout_s = max_resumes, resume_timeout_s
        self.cond = threading.Condition()
        self.waiting: list[Lost] = []
        self.moved = 0  # requests resumed on another replica (or the same one, back)
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="lockstep-router-failover", daemon=True)
        self.thread.start()

    def lost(self, origin: int, req: PendingRequest, cause: ClientError) -> None:
        """Replica `origin` lost `req` (any thread)."""
        self.pool.lost(origin)
        dropped = req.dropped  # the router cancelled it (its client left): nothing to resume
        self.pool.replicas[origin].client._forget(req)  # it lives on as a new request on the target's client
        if dropped:
            return
        if req.resumes >= self.max_resumes:
            self._give_up(Lost(origin, req, cause, 0.0), RequestLost.MAX_RESUMES)
            return
        with self.cond:
            self.waiting.append(Lost(origin, req, cause, time.monotonic() + self.resume_timeout_s))
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            left, self.waiting = self.waiting, []
            self.cond.notify_all()
        for item in left:
            self._give_up(item, RequestLost.CLIENT_CLOSED)

    def _run(self) -> None:
        next_round = 0.0
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.waiting or self.closed)
                # rounds start WAIT_S / 5 apart: what went back in line is not tried again at once
                self.cond.wait_for(lambda: self.closed, max(0.0, next_round - time.monotonic()))
                if self.closed:
                    return
                batch, self.waiting = self.waiting, []
            next_round = time.monotonic() + WAIT_S / 5
            if not self.pool.wait_healthy(WAIT_S):
                self._requeue(batch)
                continue
            for item in batch:
                try:
                    self._resume(item)
                except Exception as e:  # never leave a request waiting for a thread that died
                    log.exception("router: resuming %s failed", item.req.request_id)
                    self._give_up(item, RequestLost.REFUSED, f"the resume failed: {type(e).__name__}: {e}")

    def _requeue(self, items: list[Lost]) -> None:
        """Put `items` back in line, or end those past their deadline (any thread: a refusal comes on the target
        client's I/O thread, which must not sleep; the failover thread spaces its rounds)."""
        now = time.monotonic()
        for item in [i for i in items if i.deadline <= now]:
            self._give_up(item, RequestLost.NO_SERVER, f"no healthy replica within resume_timeout_s="
                                                       f"{self.resume_timeout_s:g}")
        with self.cond:
            self.waiting.extend(i for i in items if i.deadline > now)
            self.cond.notify_all()

    def _resume(self, item: Lost) -> None:
        """Submit the request again on a healthy replica; a refusal worth retrying puts it back in line."""
        target = self.pool.for_resume(item.origin)
        if target is None:
            self._requeue([item])
            return
        old = item.req
        fields = old.resume_fields()
        sampling = fields.pop("sampling", None) or {}
        try:
            new, accepted = target.client.submit_future(fields.pop("input_ids", None), **fields, **sampling)
        except ClientError as e:  # the target's client refused it locally (an id it still tracks)
            self.pool.finished(target.index)
            self._retry_or_end(item, e)
            return

        def on_accepted(f: Future) -> None:  # its tokens wait in its stream until the router takes it
            error = f.exception() if not f.cancelled() else ClientError(Code.CLIENT_CLOSED, "cancelled")
            if error is None:
                self.moved += 1
                self.on_moved(old.request_id, new, target)
                return
            self.pool.finished(target.index)  # refused: the submit already ended and forgot `new`
            self._retry_or_end(item, error)

        accepted.add_done_callback(on_accepted)

    def _retry_or_end(self, item: Lost, error: BaseException) -> None:
        if isinstance(error, ClientError) and error.code in RETRY_CODES:
            self._requeue([item])
        else:
            self._give_up(item, RequestLost.REFUSED, f"the replica refused the resume: {error}")

    def _give_up(self, item: Lost, reason: str, why: str | None = None) -> None:
        self.on_failed(item.req.request_id, lost_error(item.req, item.cause, reason, why))
