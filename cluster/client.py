"""Clients of a running cluster: `Client` (blocking, thread-safe) and `AsyncClient` (asyncio).

One I/O thread per client owns the ZeroMQ DEALER socket; calls hand it frames and wait on futures, so one
client carries thousands of concurrent requests from any number of threads or tasks. While requests are
outstanding the I/O thread pings the server, which cancels the requests of a client that goes quiet.

A client connects lazily and pickles as its address only, so a handle can be passed into Ray tasks and
actors and reconnects in each worker process. Only torch-free modules are imported here.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from typing import Any, AsyncIterator, Iterator

import zmq

from cluster import protocol as P
from cluster.errors import ClientError, ServerGone, WeightUpdateError  # noqa: F401  (re-exported)
from cluster.outputs import GenerationOutput, RequestStatus

PING_EVERY_S = 1.0


class _Request:
    def __init__(self, request_id: str, prompt_ids: list[int] | None):
        self.request_id = request_id
        self.prompt_ids = prompt_ids or []
        self.tokens: list[int] = []
        self.final: Future = Future()  # done when the server sent the final output (or an error)
        self.stream: queue.Queue = queue.Queue()  # GenerationOutput, the last one final


class _IOThread:
    """Owns the socket; everything else talks to it through `post` and futures."""

    def __init__(self, address: str, server_key: bytes | None, client_keys: tuple[bytes, bytes] | None,
                 max_frame_bytes: int):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if server_key:
            public, secret = client_keys or zmq.curve_keypair()
            self.sock.curve_serverkey, self.sock.curve_publickey, self.sock.curve_secretkey = server_key, public, secret
        self.sock.connect(address)
        self.max_frame_bytes = max_frame_bytes
        self.outbox: deque[bytes] = deque()
        self.replies: dict[Any, Future] = {}
        self.requests: dict[str, _Request] = {}
        self.lock = threading.Lock()
        self.mids = itertools.count(1)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="lockstep-client", daemon=True)
        self.thread.start()

    def call(self, kind: str, **fields: Any) -> Future:
        """Send one message; the future resolves to its reply message (or raises ClientError)."""
        fut: Future = Future()
        with self.lock:
            mid = next(self.mids)
            self.replies[mid] = fut
            self.outbox.append(P.encode(kind, mid=mid, **fields))
        self._wake()
        return fut

    def track(self, req: _Request) -> None:
        with self.lock:
            self.requests[req.request_id] = req

    def _wake(self) -> None:
        with self.lock:  # the I/O thread closes the pipe under the lock: never write to a reused fd number
            if self.wake_w < 0:
                return
            try:
                os.write(self.wake_w, b"x")
            except BlockingIOError:
                pass

    def close(self) -> None:
        """Say goodbye and end the thread, which closes the socket, the context and the wake pipe itself
        (so that close may also run on the I/O thread, e.g. from a finalizer the garbage collector calls)."""
        if self.closed:
            return
        with self.lock:
            self.outbox.append(P.encode(P.BYE))
        self.closed = True
        self._wake()
        if threading.current_thread() is not self.thread:
            self.thread.join(5)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        last_ping = time.monotonic()
        while True:
            events = dict(poller.poll(int(PING_EVERY_S * 1000)))
            if self.wake_r in events:
                os.read(self.wake_r, 65536)
            with self.lock:
                frames, self.outbox = list(self.outbox), deque()
            for f in frames:
                self.sock.send(f)
            if self.closed:
                self.sock.close(0)
                self.ctx.term()
                with self.lock:
                    os.close(self.wake_r)
                    os.close(self.wake_w)
                    self.wake_r = self.wake_w = -1
                return
            if self.sock in events:
                while True:
                    try:
                        frame = self.sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        self._on_message(P.decode_reply(frame, self.max_frame_bytes))
                    except P.ProtocolError:
                        pass  # not a message of ours: drop it
            busy = any(not r.final.done() for r in list(self.requests.values()))
            if busy and time.monotonic() - last_ping > PING_EVERY_S:
                self.sock.send(P.encode(P.PING))
                last_ping = time.monotonic()

    def _on_message(self, msg: dict) -> None:
        kind = msg.get("kind")
        if kind in (P.ACCEPTED, P.REPLY, P.REJECTED, P.ERROR) and msg.get("mid") in self.replies:
            with self.lock:
                fut = self.replies.pop(msg["mid"])
            if kind in (P.REJECTED, P.ERROR):
                fut.set_exception(ClientError(msg.get("code", P.Code.INTERNAL), msg.get("message", ""),
                                              msg.get("request_id")))
            else:
                fut.set_result(msg)
            return
        rid = msg.get("request_id") or (msg.get("output") or {}).get("request_id")
        req = self.requests.get(rid)
        if req is None:
            return
        if kind == P.TOKENS:
            req.tokens.extend(msg["tokens"])
            req.stream.put(GenerationOutput(request_id=rid, prompt_ids=req.prompt_ids,
                                            generated_tokens=list(req.tokens), status=RequestStatus.DECODING))
        elif kind == P.FINAL:  # the request stays tracked until `result` or `stream` collects it
            out = GenerationOutput.from_dict(msg["output"])
            req.stream.put(out)
            req.final.set_result(out)
        elif kind == P.ERROR:  # a request failed on the server side (e.g. a rank died)
            err = ClientError(msg.get("code", P.Code.INTERNAL), msg.get("message", ""), rid)
            req.stream.put(err)
            req.final.set_exception(err)


def _checked(item: GenerationOutput | Exception) -> GenerationOutput:
    """A streamed item, or the server's error for the request raised."""
    if isinstance(item, Exception):
        raise item
    return item


class Client:
    """Blocking client of a Lockstep cluster at `address`."""

    def __init__(self, address: str = P.DEFAULT_ADDRESS, server_key: bytes | None = None,
                 client_keys: tuple[bytes, bytes] | None = None, timeout: float | None = 600.0,
                 max_frame_bytes: int = P.DEFAULT_MAX_FRAME_BYTES):
        self.address, self.server_key, self.client_keys = address, server_key, client_keys
        self.timeout, self.max_frame_bytes = timeout, max_frame_bytes
        self._io: _IOThread | None = None
        self._io_lock = threading.Lock()

    # a handle crosses process boundaries (Ray) as its settings; each process connects on first use
    def __getstate__(self) -> dict:
        return {"address": self.address, "server_key": self.server_key, "client_keys": self.client_keys,
                "timeout": self.timeout, "max_frame_bytes": self.max_frame_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def io(self) -> _IOThread:
        with self._io_lock:
            if self._io is None or self._io.closed:
                self._io = _IOThread(self.address, self.server_key, self.client_keys, self.max_frame_bytes)
                # a handle dropped without close() must not leave its thread, socket and pipe behind: a Ray
                # worker process unpickles a fresh handle for every task it runs and lives on after them
                self._finalizer = weakref.finalize(self, self._io.close)
                self._finalizer.atexit = False  # at exit the daemon thread just dies, as before
            return self._io

    def close(self) -> None:
        """Say goodbye (the server cancels this client's unfinished requests) and close the socket.
        A client that is garbage-collected without close() is closed the same way."""
        if self._io is not None:
            self._finalizer.detach()
            self._io.close()
            self._io = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _wait(self, fut: Future, timeout: float | None = None) -> Any:
        return fut.result(timeout if timeout is not None else self.timeout)

    def submit_future(self, input_ids: list[int] | None = None, *, text: str | None = None,
                      request_id: str | None = None, max_new_tokens: int | None = None, streaming: bool = False,
                      eos_token_id: int | list[int] | None = None, **sampling: Any) -> tuple[_Request, Future]:
        """Send a submit; the future resolves to the request id once the server accepts it."""
        rid = request_id or os.urandom(12).hex()
        fields: dict[str, Any] = {"max_new_tokens": max_new_tokens, "streaming": streaming, "sampling": sampling,
                                  "request_id": rid, "eos_token_id": eos_token_id}
        if text is not None:
            fields["text"] = text
        else:
            fields["input_ids"] = list(input_ids) if input_ids is not None else None
        io = self.io
        req = _Request(rid, input_ids)
        io.track(req)  # before the submit leaves, so no token can slip by
        accepted: Future = Future()

        def on_reply(f: Future) -> None:
            try:
                f.result()
            except BaseException as e:
                with io.lock:
                    io.requests.pop(rid, None)
                accepted.set_exception(e)
                return
            accepted.set_result(rid)

        io.call(P.SUBMIT, **fields).add_done_callback(on_reply)
        return req, accepted

    def submit(self, input_ids: list[int] | None = None, **params: Any) -> str:
        """Queue a request; returns its id once the server accepted it (ClientError if rejected)."""
        _, fut = self.submit_future(input_ids, **params)
        return self._wait(fut)

    def _collect(self, request_id: str) -> _Request:
        req = self.io.requests.get(request_id)
        if req is None:
            raise ClientError(P.Code.UNKNOWN_REQUEST, f"no request {request_id!r} is outstanding on this client")
        return req

    def _forget(self, request_id: str) -> None:
        with self.io.lock:
            self.io.requests.pop(request_id, None)

    def result(self, request_id: str, timeout: float | None = None) -> GenerationOutput:
        """The final output of a submitted request (ClientError if the server failed it)."""
        req = self._collect(request_id)
        try:
            out = self._wait(req.final, timeout)
        except ClientError:
            self._forget(request_id)
            raise
        self._forget(request_id)
        return out

    def generate(self, input_ids: list[int] | None = None, **params: Any) -> GenerationOutput:
        return self.result(self.submit(input_ids, **params))

    def stream(self, input_ids: list[int] | None = None, **params: Any) -> Iterator[GenerationOutput]:
        """One output per generated token (cumulative tokens), then the final output."""
        params["streaming"] = True
        req, fut = self.submit_future(input_ids, **params)
        self._wait(fut)
        try:
            while not (item := _checked(req.stream.get(timeout=self.timeout))).is_finished():
                yield item
            yield item
        finally:
            self._forget(req.request_id)

    def cancel(self, request_id: str) -> None:
        self._wait(self.io.call(P.CANCEL, request_id=request_id))

    def pause(self) -> None:
        """Hold scheduling on the cluster: in-flight requests keep their KV, new ones queue."""
        self._wait(self.io.call(P.PAUSE))

    def resume(self) -> None:
        self._wait(self.io.call(P.RESUME))

    def update_weights(self, path: str, kv_policy: str = "keep") -> dict:
        return self._wait(self.io.call(P.UPDATE_WEIGHTS, path=path, kv_policy=kv_policy))["data"]

    def stats(self) -> dict:
        return self._wait(self.io.call(P.STATS))["data"]

    def health(self, timeout: float | None = 10.0) -> dict:
        return self._wait(self.io.call(P.HEALTH), timeout)["data"]


class AsyncClient:
    """The same calls as `Client`, as coroutines; `stream` is an async iterator."""

    def __init__(self, address: str = P.DEFAULT_ADDRESS, **kwargs: Any):
        self.client = Client(address, **kwargs)

    def __getstate__(self) -> dict:
        return self.client.__getstate__()

    def __setstate__(self, state: dict) -> None:
        self.client = Client(**state)

    async def _await(self, fut: Future) -> Any:
        return await asyncio.wrap_future(fut)

    async def submit(self, input_ids: list[int] | None = None, **params: Any) -> str:
        _, fut = self.client.submit_future(input_ids, **params)
        return await self._await(fut)

    async def result(self, request_id: str) -> GenerationOutput:
        req = self.client._collect(request_id)
        try:
            return await self._await(req.final)
        finally:
            self.client._forget(request_id)

    async def generate(self, input_ids: list[int] | None = None, **params: Any) -> GenerationOutput:
        return await self.result(await self.submit(input_ids, **params))

    async def stream(self, input_ids: list[int] | None = None, **params: Any) -> AsyncIterator[GenerationOutput]:
        params["streaming"] = True
        req, fut = self.client.submit_future(input_ids, **params)
        await self._await(fut)
        loop = asyncio.get_running_loop()
        try:
            while not (item := _checked(await loop.run_in_executor(None, req.stream.get))).is_finished():
                yield item
            yield item
        finally:
            self.client._forget(req.request_id)

    async def cancel(self, request_id: str) -> None:
        await self._await(self.client.io.call(P.CANCEL, request_id=request_id))

    async def pause(self) -> None:
        await self._await(self.client.io.call(P.PAUSE))

    async def resume(self) -> None:
        await self._await(self.client.io.call(P.RESUME))

    async def update_weights(self, path: str, kv_policy: str = "keep") -> dict:
        return (await self._await(self.client.io.call(P.UPDATE_WEIGHTS, path=path, kv_policy=kv_policy)))["data"]

    async def stats(self) -> dict:
        return (await self._await(self.client.io.call(P.STATS)))["data"]

    async def health(self) -> dict:
        return (await self._await(self.client.io.call(P.HEALTH)))["data"]

    async def close(self) -> None:
        self.client.close()
