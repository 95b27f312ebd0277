"""The I/O thread behind a client: it alone owns the ZeroMQ DEALER socket; calls hand it frames and wait on futures.

While anything is outstanding (a request, a reply, a held pause) it pings the server every second; a server
silent for `server_timeout_s` is gone (`ServerGone`). The pong names the server (an id new at each start), like
each `accepted`, so a request accepted by a server restarted since is lost too. An exception in the thread ends
every call with `client_failed`; either way the client's next call opens a fresh thread. A lost request goes to
`on_lost` when resumable (cluster/client/resume.py), else ends with RequestLost. Torch-free.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from cluster import protocol as P
from cluster.errors import ClientError, Code, RequestLost, ServerGone
from cluster.outputs import GenerationOutput
from cluster.client.pending import PendingRequest, settle
from cluster.client.resume import lost_error
from cluster.wake_pipe import WakePipe

log = logging.getLogger("lockstep")

PING_EVERY_S = 1.0
CLOSE_LINGER_MS = 1000  # how long close() lets the `bye` (and anything queued before it) reach the server
FAILED_LINGER_MS = 200  # the best-effort `bye` of a thread that failed or lost its server
DRAIN_AT_MOST = 1000  # frames read per round, so the outbox and the silence check are never starved
# failures after which a request can be resumed: the server (or the connection to it) lost it, not refused it
# (client_failed, a bug in this client's I/O thread, is reported as it is)
RESUMABLE = frozenset({Code.RANK_FAILED, Code.DRIVER_FAILED, Code.WEIGHTS_DIVERGED, Code.SERVER_GONE})


def then(fut: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of `fn(result of fut)`; `fn` may raise, and `fut`'s error passes through unchanged."""
    out: Future = Future()

    def done(f: Future) -> None:
        if f.cancelled():
            out.cancel()
        elif (error := f.exception()) is not None:
            settle(out, error=error)
        else:
            try:
                settle(out, fn(f.result()))
            except Exception as e:
                settle(out, error=e)

    fut.add_done_callback(done)
    return out


class IOThread:
    """Owns the socket; everything else talks to it through `call`, `track` and futures."""

    def __init__(self, address: str, server_key: bytes | None, client_keys: tuple[bytes, bytes] | None,
                 max_frame_bytes: int, server_timeout_s: float = 5.0,
                 on_lost: Callable[[PendingRequest, ClientError], None] | None = None):
        """`on_lost(req, error)`: takes a resumable request the server lost (None: such requests fail)."""
        self.address, self.max_frame_bytes, self.server_timeout_s = address, max_frame_bytes, server_timeout_s
        self.on_lost = on_lost
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if server_key:
            self.sock.curve_serverkey = server_key
            self.sock.curve_publickey, self.sock.curve_secretkey = client_keys or zmq.curve_keypair()
        self.sock.connect(address)
        self.outbox: deque[bytes] = deque()
        self.replies: dict[Any, Future] = {}
        self.requests: dict[str, PendingRequest] = {}  # tracked until the caller collects them
        self.open: set[str] = set()  # ids of tracked requests whose final output has not come
        self.pause_held = False  # this client holds the server's pause
        self.lock = threading.RLock()  # a finalizer may close the client on this thread while holding it
        self.mids = itertools.count(1)
        self.heard = time.monotonic()  # when the last frame from the server arrived
        self.busy_since = time.monotonic()  # when something last became outstanding after nothing was
        self.waker = WakePipe()
        self.closed = False  # no more calls: close() was called or the thread ended
        self.failure: ClientError | None = None  # why the thread ended, when it did not end by close()
        self.thread = threading.Thread(target=self._run, name="lockstep-client", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ calls (any thread)
    def _busy(self) -> bool:
        return bool(self.open or self.replies or self.pause_held)

    def _ended(self) -> ClientError:
        return self.failure or ClientError(Code.CLIENT_CLOSED, "the client was closed")

    def call(self, kind: str, **fields: Any) -> Future:
        """Send one message; the future resolves to its reply message (or raises ClientError)."""
        fut: Future = Future()
        with self.lock:
            if self.closed:
                settle(fut, error=self._ended())
                return fut
            if not self._busy():
                self.busy_since = time.monotonic()
            mid = next(self.mids)
            self.replies[mid] = fut
            self.outbox.append(P.encode(kind, mid=mid, **fields))
        self.waker.wake()
        return fut

    def track(self, req: PendingRequest, again: bool = False) -> None:
        """Track a request before its submit leaves, so no token can slip by. An id already tracked is refused,
        unless `again`: the resume tracks its request again (an I/O thread that ended may have tracked it)."""
        with self.lock:
            if self.closed:
                raise self._ended()
            if not again and req.request_id in self.requests:
                raise ClientError(Code.DUPLICATE_REQUEST_ID, f"request id {req.request_id!r} is already "
                                  "outstanding on this client", req.request_id)
            if not self._busy():
                self.busy_since = time.monotonic()
            self.requests[req.request_id] = req
            self.open.add(req.request_id)

    def finish(self, req: PendingRequest, output: GenerationOutput | None = None,
               error: BaseException | None = None) -> None:
        """The request's end: its final output or its error, to its future and its stream."""
        self.set_waiting(req)
        if not req.final.done():
            req.put(output if error is None else error)
            settle(req.final, output, error)

    def set_waiting(self, req: PendingRequest) -> None:
        """Not outstanding here any more (ended, or waiting for a resume), still tracked: its caller collects it."""
        with self.lock:
            if self.requests.get(req.request_id) is req:
                self.open.discard(req.request_id)

    def lose(self, req: PendingRequest, error: ClientError) -> None:
        """The server lost the request: to `on_lost`, or ended with RequestLost (a second report is ignored)."""
        with self.lock:
            if self.requests.get(req.request_id) is not req or req.request_id not in self.open:
                return
            self.open.discard(req.request_id)
        if req.resumable and self.on_lost is not None and error.code in RESUMABLE:
            self.on_lost(req, error)
            return
        reason = RequestLost.RESUME_OFF if error.code in RESUMABLE else RequestLost.CLIENT_CLOSED
        self.finish(req, error=lost_error(req, error, reason) if req.resumable or error.code in RESUMABLE else error)

    def forget(self, req: PendingRequest) -> None:
        """The caller collected the request (or gave up on it): stop tracking it."""
        with self.lock:
            if self.requests.get(req.request_id) is req:
                del self.requests[req.request_id]
                self.open.discard(req.request_id)

    def adopt(self, old: "IOThread") -> None:
        """Take over the requests of a thread that ended, so their callers still collect their errors."""
        with old.lock:
            taken = dict(old.requests)
        with self.lock:
            self.requests = taken | self.requests

    def set_pause_held(self, held: bool) -> None:
        with self.lock:
            self.pause_held = held

    def close(self) -> None:
        """Say goodbye and end the thread, which fails what is outstanding and closes the socket itself, so close
        may also run on the I/O thread (from a garbage collector's finalizer)."""
        with self.lock:
            if self.closed:
                return
            self.outbox.append(P.encode(P.BYE))
            self.closed = True
        self.waker.wake()
        if threading.current_thread() is not self.thread:
            self.thread.join(5)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            failure = self._serve()
        except Exception as e:  # a bug or a broken socket must not leave every caller waiting
            log.exception("lockstep client: the I/O thread failed")
            failure = ClientError(Code.CLIENT_FAILED, f"the client's I/O thread failed: {type(e).__name__}: {e}")
        self._end(failure)

    def _serve(self) -> ServerGone | None:
        """The loop; returns None once closed, or ServerGone when the server fell silent."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.waker.fd, zmq.POLLIN)
        last_ping = 0.0
        while True:
            with self.lock:
                wait = 0.02 if self.outbox else 0.25 if self._busy() else PING_EVERY_S
            events = dict(poller.poll(int(wait * 1000)))
            if self.waker.fd in events:
                self.waker.drain()
            if self.closed:
                return None
            self._flush()
            if self.sock in events:
                self._drain()
            now = time.monotonic()
            with self.lock:
                busy, since = self._busy(), max(self.heard, self.busy_since)
            if not busy:
                continue
            if now - since > self.server_timeout_s:
                return ServerGone(f"the server at {self.address} sent nothing for {now - since:.1f} s")
            if now - last_ping >= PING_EVERY_S:
                self._send(P.encode(P.PING))
                last_ping = now

    def _send(self, frame: bytes) -> bool:
        try:
            self.sock.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:  # the pipe to the server is full (or the server is not there): keep it
            return False

    def _flush(self) -> None:
        with self.lock:
            frames, self.outbox = self.outbox, deque()
        while frames and self._send(frames[0]):
            frames.popleft()
        if frames:
            with self.lock:
                frames.extend(self.outbox)
                self.outbox = frames

    def _drain(self) -> None:
        for _ in range(DRAIN_AT_MOST):
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.heard = time.monotonic()
            try:
                msg = P.decode_reply(frame, self.max_frame_bytes)
            except P.ProtocolError:
                continue  # not a message of ours: drop it
            self._on_message(msg)

    def _on_message(self, msg: dict) -> None:
        kind = msg.get("kind")
        if kind == P.PONG:
            self._check_server(msg.get("server"))
            return
        if kind == P.ACCEPTED and (req := self._tracked(msg.get("request_id"))) is not None:
            req.server = msg.get("server")  # before the reply resolves: the submit's callbacks may read it
        if kind in (P.ACCEPTED, P.REPLY, P.REJECTED, P.ERROR) and msg.get("mid") is not None:
            with self.lock:
                fut = self.replies.pop(msg["mid"], None)
            if fut is not None:
                if kind in (P.REJECTED, P.ERROR):
                    settle(fut, error=ClientError(msg.get("code", Code.INTERNAL), msg.get("message", ""),
                                                  msg.get("request_id")))
                else:
                    settle(fut, msg)
                return
        rid = msg.get("request_id") or (msg.get("output") or {}).get("request_id")
        if (req := self._tracked(rid)) is None or req.final.done():
            return
        if kind == P.TOKENS:
            index = msg.get("index")
            try:
                out = req.delivered(index if isinstance(index, int) else len(req.tokens), msg["tokens"],
                                    msg.get("versions") or [], msg.get("text"), msg.get("logprobs"),
                                    msg.get("top_logprobs"))
                if out is not None:
                    req.put(out)
            except ValueError as e:
                self.finish(req, error=ClientError(Code.INTERNAL, str(e), rid))
        elif kind == P.FINAL:  # the request stays tracked until `result` or `stream` collects it
            self.finish(req, GenerationOutput.from_dict(msg["output"]))
        elif kind == P.ERROR:  # a request failed on the server side (e.g. a rank died)
            error = ClientError(msg.get("code", Code.INTERNAL), msg.get("message", ""), rid)
            if error.code in RESUMABLE:
                self.lose(req, error)
            else:
                self.finish(req, error=error)

    def _tracked(self, rid: Any) -> PendingRequest | None:
        with self.lock:
            return self.requests.get(rid) if isinstance(rid, str) else None

    def _check_server(self, server: Any) -> None:
        """A pong names the server answering; requests another one accepted are lost (restarted in between)."""
        if not isinstance(server, str):
            return
        with self.lock:
            stale = [req for rid in self.open if (req := self.requests.get(rid)) is not None
                     and req.server is not None and req.server != server]
        for req in stale:
            self.lose(req, ServerGone(f"the server at {self.address} restarted (server {req.server} is now "
                                      f"{server}); it no longer holds this request", req.request_id))

    def _end(self, failure: ClientError | None) -> None:
        """Fail everything outstanding, say goodbye (best effort after a failure), release the socket."""
        with self.lock:
            self.closed, self.failure = True, failure
            error = self._ended()
            replies, self.replies = list(self.replies.values()), {}
            reqs = [self.requests[rid] for rid in self.open if rid in self.requests]
            self.pause_held = False
            frames = self.outbox if failure is None else deque([P.encode(P.BYE)])
            self.outbox = deque()
        for req in reqs:
            self.lose(req, error)
        for fut in replies:
            settle(fut, error=error)
        linger = CLOSE_LINGER_MS if failure is None else FAILED_LINGER_MS
        try:
            deadline = time.monotonic() + linger / 1000
            for f in frames:  # blocking sends (bounded by the linger): a full pipe must not drop the bye
                self.sock.setsockopt(zmq.SNDTIMEO, max(1, int((deadline - time.monotonic()) * 1000)))
                try:
                    self.sock.send(f)
                except zmq.Again:
                    break
            self.sock.close(linger=linger)
            self.ctx.term()
        finally:
            self.waker.close()
