"""The I/O thread behind a client: it alone owns the ZeroMQ DEALER socket.

Calls hand it frames (`call`, `track`) and wait on futures. While anything is outstanding (a request, a
reply, or a pause this client holds) it pings the server every second; the server answers each ping with a
`pong`, so a server that sends nothing at all for `server_timeout_s` is taken as gone, and every outstanding
future and stream ends with `ServerGone`. An exception inside the thread ends every outstanding call with
`client_failed` instead of leaving them waiting; either way the thread ends, and the client's next call
opens a fresh one. `close()` delivers the `bye`, so the server cancels this client's requests at once.
Only torch-free modules are imported here.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable

import zmq

from cluster import protocol as P
from cluster.errors import ClientError, Code, ServerGone
from cluster.outputs import GenerationOutput, RequestStatus

log = logging.getLogger("lockstep")

PING_EVERY_S = 1.0
CLOSE_LINGER_MS = 1000  # how long close() lets the `bye` (and anything queued before it) reach the server
FAILED_LINGER_MS = 200  # the best-effort `bye` of a thread that failed or lost its server
DRAIN_AT_MOST = 1000  # frames read per round, so the outbox and the silence check are never starved


def settle(fut: Future, result: Any = None, error: BaseException | None = None) -> bool:
    """Resolve `fut` once; a future already done (or cancelled by an asyncio waiter) is left alone."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
        return True
    except InvalidStateError:
        return False


def then(fut: Future, fn: Callable[[Any], Any], on_ok: Callable[[], None] | None = None) -> Future:
    """A future of `fn(result of fut)`; `fn` may raise, and `fut`'s error passes through unchanged."""
    out: Future = Future()

    def done(f: Future) -> None:
        if f.cancelled():
            out.cancel()
            return
        error = f.exception()
        if error is not None:
            settle(out, error=error)
            return
        try:
            value = fn(f.result())
        except Exception as e:
            settle(out, error=e)
            return
        settle(out, value)

    fut.add_done_callback(done)
    return out


class PendingRequest:
    """A submitted request as its client sees it: a future for its final output and a queue of streamed
    outputs (cumulative tokens; the last one final, or the error that ended it)."""

    def __init__(self, request_id: str, prompt_ids: list[int] | None):
        self.request_id = request_id
        self.prompt_ids = prompt_ids or []
        self.tokens: list[int] = []
        self.final: Future = Future()
        self.stream: queue.Queue = queue.Queue()
        self._arrivals: list[Future] = []  # resolved at the next put (asyncio waiters await them)
        self._arrivals_lock = threading.Lock()

    def put(self, item: GenerationOutput | Exception) -> None:
        with self._arrivals_lock:
            self.stream.put(item)
            waiting, self._arrivals = self._arrivals, []
        for fut in waiting:
            settle(fut)

    def arrival(self) -> Future:
        """A future resolved once the stream holds an item (at once if it already does)."""
        fut: Future = Future()
        with self._arrivals_lock:
            if self.stream.empty():
                self._arrivals.append(fut)
                return fut
        settle(fut)
        return fut

    @staticmethod
    def _checked(item: GenerationOutput | Exception) -> GenerationOutput:
        if isinstance(item, Exception):
            raise item
        return item

    def next_item(self, timeout: float | None) -> GenerationOutput:
        """The next streamed output; the error that ended the request is raised."""
        try:
            return self._checked(self.stream.get(timeout=timeout))
        except queue.Empty:
            raise TimeoutError(f"no output for request {self.request_id!r} within {timeout} s") from None

    async def next_item_async(self, timeout: float | None) -> GenerationOutput:
        """`next_item` for asyncio: waits without holding a thread."""
        while True:
            try:
                return self._checked(self.stream.get_nowait())
            except queue.Empty:
                pass
            try:
                await asyncio.wait_for(asyncio.wrap_future(self.arrival()), timeout)
            except TimeoutError:  # asyncio's, since 3.11 the builtin
                raise TimeoutError(f"no output for request {self.request_id!r} within {timeout} s") from None


class IOThread:
    """Owns the socket; everything else talks to it through `call`, `track` and futures."""

    def __init__(self, address: str, server_key: bytes | None, client_keys: tuple[bytes, bytes] | None,
                 max_frame_bytes: int, server_timeout_s: float = 5.0):
        self.address, self.max_frame_bytes, self.server_timeout_s = address, max_frame_bytes, server_timeout_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if server_key:
            public, secret = client_keys or zmq.curve_keypair()
            self.sock.curve_serverkey = server_key
            self.sock.curve_publickey, self.sock.curve_secretkey = public, secret
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
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
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
        self._wake()
        return fut

    def track(self, req: PendingRequest) -> None:
        """Start tracking a request before its submit leaves, so no token can slip by. A request id this
        client already tracks is refused here, leaving the original untouched."""
        with self.lock:
            if self.closed:
                raise self._ended()
            if req.request_id in self.requests:
                raise ClientError(Code.DUPLICATE_REQUEST_ID, f"request id {req.request_id!r} is already "
                                  "outstanding on this client", req.request_id)
            if not self._busy():
                self.busy_since = time.monotonic()
            self.requests[req.request_id] = req
            self.open.add(req.request_id)

    def finish(self, req: PendingRequest, output: GenerationOutput | None = None,
               error: BaseException | None = None) -> None:
        """The request's end: its final output or its error, to its future and its stream."""
        with self.lock:
            if self.requests.get(req.request_id) is req:
                self.open.discard(req.request_id)
        if req.final.done():
            return
        req.put(output if error is None else error)
        settle(req.final, output, error)

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
            for rid, req in taken.items():
                self.requests.setdefault(rid, req)

    def set_pause_held(self, held: bool) -> None:
        with self.lock:
            self.pause_held = held

    def _wake(self) -> None:
        with self.lock:  # the I/O thread closes the pipe under the lock: never write to a reused fd number
            if self.wake_w < 0:
                return
            try:
                os.write(self.wake_w, b"x")
            except BlockingIOError:
                pass

    def close(self) -> None:
        """Say goodbye and end the thread, which fails what is still outstanding (`client_closed`) and
        closes the socket (delivering the `bye`), the context and the wake pipe itself, so that close may
        also run on the I/O thread (e.g. from a finalizer the garbage collector calls)."""
        with self.lock:
            if self.closed:
                return
            self.outbox.append(P.encode(P.BYE))
            self.closed = True
        self._wake()
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
        poller.register(self.wake_r, zmq.POLLIN)
        last_ping = 0.0
        while True:
            with self.lock:
                wait = 0.02 if self.outbox else 0.25 if self._busy() else PING_EVERY_S
            events = dict(poller.poll(int(wait * 1000)))
            if self.wake_r in events:
                os.read(self.wake_r, 65536)
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
        with self.lock:
            req = self.requests.get(rid) if isinstance(rid, str) else None
        if req is None or req.final.done():
            return
        if kind == P.TOKENS:
            req.tokens.extend(msg["tokens"])
            req.put(GenerationOutput(request_id=rid, prompt_ids=req.prompt_ids,
                                            generated_tokens=list(req.tokens), status=RequestStatus.DECODING))
        elif kind == P.FINAL:  # the request stays tracked until `result` or `stream` collects it
            self.finish(req, GenerationOutput.from_dict(msg["output"]))
        elif kind == P.ERROR:  # a request failed on the server side (e.g. a rank died)
            self.finish(req, error=ClientError(msg.get("code", Code.INTERNAL), msg.get("message", ""), rid))

    def _end(self, failure: ClientError | None) -> None:
        """Fail everything outstanding, say goodbye (delivered on close, best effort on a failure) and
        release the socket, the context and the wake pipe."""
        with self.lock:
            self.closed = True
            self.failure = failure
            error = self._ended()
            replies, self.replies = list(self.replies.values()), {}
            reqs = [self.requests[rid] for rid in self.open if rid in self.requests]
            self.pause_held = False
            frames = self.outbox if failure is None else deque([P.encode(P.BYE)])
            self.outbox = deque()
        for req in reqs:
            self.finish(req, error=error)
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
            with self.lock:
                os.close(self.wake_r)
                os.close(self.wake_w)
                self.wake_r = self.wake_w = -1
