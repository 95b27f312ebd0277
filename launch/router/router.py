"""One front door for several replicas: a ZeroMQ ROUTER socket speaking the driver's protocol (docs/protocol.md).

Clients connect to the router exactly as to one group's front door (docs/replicas.md). Each submit goes to one
replica (replica_pool.py `choose`) through that replica's client, always streaming, so the router holds the tokens
a resume needs (failover.py); `health`, `stats` and `update_weights` are answered here (stats.py); `pause` and
`resume` are refused with `unsupported`. A client that says `bye`, goes quiet or disconnects has its requests
cancelled. One thread owns the socket; other threads hand it events through a queue. Torch-free."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from cluster import protocol as P
from cluster.errors import ClientError, Code
from launch.router.failover import Failover
from cluster.outputs import GenerationOutput, versions_between
from cluster.client.pending import PendingRequest
from launch.router.replica_pool import Replica, ReplicaPool
from cluster.wake_pipe import WakePipe
from driver.frontdoor.admin import binds_locally
from driver.frontdoor.client_outbox import ClientOutbox

log = logging.getLogger("lockstep")


@dataclass
class RouterConfig:
    address: str = P.DEFAULT_ADDRESS
    page_size: int = 256  # the replicas' KV page size ([continuous_batching] page_size): prefix hashes use it
    policy: str = "affinity"  # affinity, least or round_robin (launch/router/replica_pool.py)
    affinity_slack: int = 8  # outstanding requests a prefix holder may have beyond the least loaded replica
    max_frame_bytes: int = P.DEFAULT_MAX_FRAME_BYTES
    client_timeout_s: float = 30.0
    max_client_backlog: int = 4096
    health_every_s: float = 0.5
    server_timeout_s: float = 3.0  # a replica silent this long has lost its requests
    max_resumes: int = 3
    resume_timeout_s: float = 60.0
    admin: bool = True  # update_weights for clients of a loopback/ipc bind (no CURVE at the router)


@dataclass(eq=False)
class Routed:
    """A client's request as the router carries it."""

    ident: bytes
    mid: Any
    request_id: str
    streaming: bool
    up: PendingRequest  # the request on its replica's client (a new one after each failover)
    replica: int
    sent: int = 0  # generated tokens forwarded to the client
    text_sent: int = 0  # of the upstream request's cumulative text (it starts again after a failover's resume point)
    logprobs_sent: int = 0  # of its cumulative logprobs, likewise


@dataclass
class Counters:
    received: int = 0
    rejected: int = 0
    accepted: int = 0
    finished: int = 0
    failed: int = 0
    disconnect_cancels: int = 0
    weight_updates: int = 0
    clients: dict[bytes, float] = field(default_factory=dict)  # ident -> when last heard


class Router:
    def __init__(self, addresses: list[str], config: RouterConfig, fallback_paths: list[str | None] | None = None):
        """`addresses`: each replica's front door; `fallback_paths`: each one's model directory (a fleet update's
        rollback to the initial weights)."""
        from launch.router.stats import RouterStats

        self.config = config
        self.server = uuid.uuid4().hex
        self.pool = ReplicaPool(addresses, config.page_size, lambda *lost: self.failover.lost(*lost), config.policy,
                                config.affinity_slack, config.health_every_s, config.server_timeout_s)
        self.failover = Failover(self.pool, lambda rid, new, target: self.later(lambda: self._moved(rid, new, target)),
                                 lambda rid, error: self.later(lambda: self._ended(rid, error)), config.max_resumes,
                                 config.resume_timeout_s)
        self.stats = RouterStats(self, fallback_paths or [None] * len(addresses))
        self.counters = Counters()
        self.routed: dict[str, Routed] = {}
        self.events: deque[Callable[[], None]] = deque()  # run on the router thread
        self.waker = WakePipe()
        self.stop_event = threading.Event()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * config.max_frame_bytes)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(config.address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.admin = config.admin and binds_locally(self.address)
        self.outbox = ClientOutbox(self.sock, config.max_client_backlog, self._drop_client, self._drop_client)
        self.thread = threading.Thread(target=self._run, name="lockstep-router", daemon=True)

    def start(self, ready_timeout: float = 60.0) -> "Router":
        """Serve; returns once every replica answered health ok (RuntimeError after `ready_timeout`)."""
        self.pool.start()
        deadline = time.monotonic() + ready_timeout
        while not all(self.pool.probe(r) for r in self.pool.replicas):
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas not healthy within {ready_timeout:.0f}s: {self.pool.reports()}")
            time.sleep(0.2)
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop_event.set()
        self.waker.wake()
        if self.thread.is_alive():
            self.thread.join(10)
        self.failover.close()
        self.pool.close()
        self.sock.close(linger=0)
        self.ctx.term()
        self.waker.close()

    # ------------------------------------------------------------------ from other threads
    def later(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the router thread (any thread may call this)."""
        self.events.append(fn)
        self.waker.wake()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.waker.fd, zmq.POLLIN)
        next_sweep = time.monotonic() + 1.0
        while not self.stop_event.is_set():
            try:
                events = dict(poller.poll(250 if not self.outbox.backlogs else 10))
                if self.waker.fd in events:
                    self.waker.drain()
                while self.events:
                    self.events.popleft()()
                if self.sock in events:
                    self._drain()
                self.outbox.flush()
                if time.monotonic() > next_sweep:
                    next_sweep = time.monotonic() + 1.0
                    self._sweep()
            except Exception:  # the front door must outlive anything; the next turn goes on
                log.exception("router: unexpected error")

    def _drain(self) -> None:
        for _ in range(1000):
            try:
                ident, frame = self.sock.recv_multipart(zmq.NOBLOCK)[:2]
            except zmq.Again:
                return
            except ValueError:  # not [identity, frame]
                continue
            self.counters.clients[ident] = time.monotonic()
            self.counters.received += 1
            try:
                self._handle(ident, P.decode(frame, self.config.max_frame_bytes))
            except P.ProtocolError as e:
                self._reject(ident, e.mid, e.code, e.message, e.request_id)

    def _send(self, ident: bytes, kind: str, **fields: Any) -> None:
        self.outbox.send(ident, P.encode(kind, **fields))

    def _reject(self, ident: bytes, mid: Any, code: str, message: str, request_id: str | None = None) -> None:
        self.counters.rejected += 1
        self._send(ident, P.REJECTED, mid=mid, code=code, message=message, request_id=request_id)

    def _handle(self, ident: bytes, msg: dict) -> None:
        kind, mid = msg["kind"], msg.get("mid")
        if kind == P.PING:
            self._send(ident, P.PONG, mid=mid, server=self.server)
        elif kind == P.BYE:
            self._drop_client(ident)
        elif kind == P.SUBMIT:
            self._submit(ident, P.parse_submit(msg))
        elif kind == P.CANCEL:
            self._cancel(ident, mid, P.field(msg, "request_id", str, required=True))
        elif kind == P.HEALTH:
            self._send(ident, P.REPLY, mid=mid, data=self.stats.health())
        elif kind == P.STATS:
            self._in_thread(ident, mid, self.stats.stats)
        elif kind in (P.PAUSE, P.RESUME, P.RELEASE_MEMORY, P.RESUME_MEMORY, P.WEIGHTS_GROUP):
            raise P.ProtocolError(Code.UNSUPPORTED, f"{kind} is not offered by the router: send it to a replica "
                                                    "at its own address", mid)
        elif kind == P.UPDATE_WEIGHTS:
            if not self.admin:
                raise P.ProtocolError(Code.ADMIN_REQUIRED if self.config.admin else Code.ADMIN_DISABLED,
                                      "update_weights needs a router bound to loopback or ipc", mid)
            if P.field(msg, "source", str, "checkpoint") != "checkpoint":
                raise P.ProtocolError(Code.UNSUPPORTED, "the router updates replicas from a checkpoint only", mid)
            path, kv_policy = P.field(msg, "path", str, required=True), P.field(msg, "kv_policy", str, "keep")
            self._in_thread(ident, mid, lambda: self.stats.update_weights(path, kv_policy))

    def _in_thread(self, ident: bytes, mid: Any, fn: Callable[[], dict]) -> None:
        """Compute a reply on a thread of its own (it asks the replicas); it is sent from the router thread."""

        def run() -> None:
            try:
                data = fn()
            except Exception as e:  # noqa: BLE001  (reported to the caller, the router goes on)
                log.exception("router: %s failed", getattr(fn, "__name__", "a call"))
                why = f"{type(e).__name__}: {e}"
                self.later(lambda: self._reject(ident, mid, Code.INTERNAL, why))
                return
            self.later(lambda: self._send(ident, P.REPLY, mid=mid, data=data))

        threading.Thread(target=run, name="lockstep-router-call", daemon=True).start()

    # ------------------------------------------------------------------ requests
    def _submit(self, ident: bytes, s: P.Submit) -> None:
        rid = s.request_id or uuid.uuid4().hex
        if rid in self.routed:
            raise P.ProtocolError(Code.DUPLICATE_REQUEST_ID, f"request {rid!r} is in flight", s.mid, rid)
        replica = self.pool.choose(s.input_ids)
        params: dict[str, Any] = {"text": s.text} if s.text is not None else {}
        params |= {"stop": s.stop, "return_text": s.return_text, "logprobs": s.logprobs}
        if s.resume_tokens or s.resumes:  # a client resuming through the router
            params |= {"resume_tokens": s.resume_tokens, "resume_versions": s.resume_versions, "resumes": s.resumes}
        try:
            up, accepted = replica.client.submit_future(s.input_ids, request_id=rid, max_new_tokens=s.max_new_tokens,
                                                        streaming=True, eos_token_id=s.eos_token_id,
                                                        **params, **s.sampling)
        except ClientError as e:
            self.pool.finished(replica.index)
            raise P.ProtocolError(e.code, e.message, s.mid, rid) from None
        r = Routed(ident, s.mid, rid, s.streaming, up, replica.index, sent=len(s.resume_tokens or []))
        self.routed[rid] = r
        accepted.add_done_callback(lambda f: self.later(lambda: self._accepted(r, f.exception())))

    def _accepted(self, r: Routed, error: BaseException | None) -> None:
        if self.routed.get(r.request_id) is not r:  # its client left meanwhile
            return
        if error is not None:  # refused by the replica: the submit already ended and forgot it there
            del self.routed[r.request_id]
            self.pool.finished(r.replica)
            code = error.code if isinstance(error, ClientError) else Code.INTERNAL
            self._reject(r.ident, r.mid, code, getattr(error, "message", str(error)), r.request_id)
            return
        self.counters.accepted += 1
        self._send(r.ident, P.ACCEPTED, mid=r.mid, request_id=r.request_id, server=self.server)
        self._watch(r)

    def _watch(self, r: Routed) -> None:
        up = r.up
        up.arrival().add_done_callback(lambda _: self.later(lambda: self._forward(r, up)))

    def _forward(self, r: Routed, up: PendingRequest) -> None:
        """Send what arrived from the replica to the client (on the router thread)."""
        if self.routed.get(r.request_id) is not r or r.up is not up:
            return  # ended, or moved to another replica: the new request is watched
        while not up.stream.empty():
            item = up.stream.get_nowait()
            if isinstance(item, BaseException):
                self._ended(r.request_id, item)
                return
            if item.is_finished():
                self._final(r, item)
                return
            self._tokens(r, item)
        self._watch(r)

    def _tokens(self, r: Routed, out: GenerationOutput) -> None:
        new = out.generated_tokens[r.sent:]
        if not r.streaming or not new:  # a non-streaming caller waits for the final output only
            return
        versions = [list(p) for p in versions_between(out.weight_versions, r.sent, len(out.generated_tokens))]
        extra: dict[str, Any] = {}
        if out.text is not None:
            extra["text"], r.text_sent = out.text[r.text_sent:], len(out.text)
        if r.up.fields.get("logprobs"):
            extra["logprobs"], r.logprobs_sent = out.logprobs[r.logprobs_sent:], len(out.logprobs)
        self._send(r.ident, P.TOKENS, request_id=r.request_id, tokens=new, index=r.sent, versions=versions, **extra)
        r.sent = len(out.generated_tokens)

    def _final(self, r: Routed, out: GenerationOutput) -> None:
        """The final output (it carries every token, the last ones not sent as `tokens`, as the driver does)."""
        self._forget(r)
        self.counters.finished += 1
        self._send(r.ident, P.FINAL, output=out.to_dict() | {"request_id": r.request_id})

    def _ended(self, request_id: str, error: BaseException) -> None:
        r = self.routed.get(request_id)
        if r is None:
            return
        self._forget(r)
        self.counters.failed += 1
        code = error.code if isinstance(error, ClientError) else Code.INTERNAL
        self._send(r.ident, P.ERROR, request_id=request_id, code=code, message=getattr(error, "message", str(error)))

    def _moved(self, request_id: str, new: PendingRequest, target: Replica) -> None:
        r = self.routed.get(request_id)
        if r is None or new.resumes <= r.up.resumes:  # its client left, or a later move already came
            target.client._forget(new, cancel=True)
            self.pool.finished(target.index)
            return
        self.pool.finished(r.replica)  # the unit it held on the replica that lost it
        r.up, r.replica, r.text_sent, r.logprobs_sent = new, target.index, 0, 0
        self._watch(r)

    def _forget(self, r: Routed, cancel: bool = False) -> None:
        """The request is done here: untracked, its replica's client forgets it (`cancel`: and cancels it)."""
        del self.routed[r.request_id]
        self.pool.replicas[r.replica].client._forget(r.up, cancel=cancel)
        self.pool.finished(r.replica)

    def _cancel(self, ident: bytes, mid: Any, request_id: str) -> None:
        r = self.routed.get(request_id)
        if r is None or r.ident != ident:
            raise P.ProtocolError(Code.UNKNOWN_REQUEST, f"no request {request_id!r} of this client is in flight",
                                  mid, request_id)
        fut = self.pool.replicas[r.replica].client.data_future(P.CANCEL, request_id=request_id)
        fut.add_done_callback(lambda f: self.later(lambda: self._send(ident, P.REPLY, mid=mid, data={
            "cancelled": f.exception() is None and bool((f.result() or {}).get("cancelled"))})))

    # ------------------------------------------------------------------ clients that leave
    def _drop_client(self, ident: bytes) -> None:
        """Bye, silent, gone or not reading: its requests are cancelled on their replicas."""
        self.counters.clients.pop(ident, None)
        self.outbox.drop(ident)
        for r in [r for r in self.routed.values() if r.ident == ident]:
            self._forget(r, cancel=True)
            self.counters.disconnect_cancels += 1

    def _sweep(self) -> None:
        now = time.monotonic()
        for ident, heard in list(self.counters.clients.items()):
            if now - heard > self.config.client_timeout_s:
                self._drop_client(ident)
