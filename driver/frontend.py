"""The front door on the driver: a ZeroMQ ROUTER socket feeding the manager's request queue.

One thread owns the socket. Client messages are decoded strictly (cluster/protocol.py); every bad one gets
a `rejected` reply with a specific code, and nothing a client sends reaches the step loop unchecked. Outputs
come back from the manager's loop through a queue and a wake-up pipe, so the socket never leaves this
thread. A client that goes quiet (no message or ping within `client_timeout_s`) or says `bye` has its
requests cancelled.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from cluster import protocol as P
from cluster.outputs import GenerationOutput, RequestStatus

log = logging.getLogger("lockstep")

# the engine's ValueError messages -> wire codes (first match wins)
VALUE_ERROR_CODES = (("the prompt is empty", P.Code.EMPTY_PROMPT), ("outside the vocabulary", P.Code.TOKEN_OUT_OF_VOCAB),
                     ("max_new_tokens", P.Code.BAD_MAX_NEW_TOKENS), ("the model's context", P.Code.PROMPT_TOO_LONG),
                     ("already in flight", P.Code.DUPLICATE_REQUEST_ID))


@dataclass
class FrontendConfig:
    address: str = P.DEFAULT_ADDRESS
    max_frame_bytes: int = P.DEFAULT_MAX_FRAME_BYTES
    client_timeout_s: float = 30.0
    # CURVE: on when server_secret_file is set (a zmq certificate with the secret key, made by
    # zmq.auth.create_certificates); only clients whose public certificates lie in allowed_clients_dir get in
    curve_server_secret_file: str | None = None
    curve_allowed_clients_dir: str | None = None


@dataclass
class Owner:
    ident: bytes
    streaming: bool
    sent: int = 0  # tokens already streamed


class Frontend:
    def __init__(self, manager: Any, config: FrontendConfig, tokenizer: Any = None):
        self.manager = manager
        self.config = config
        self.tokenizer = tokenizer
        self.owners: dict[str, Owner] = {}
        self.last_seen: dict[bytes, float] = {}
        self.outputs: deque[GenerationOutput] = deque()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.stop_event = threading.Event()
        self.paused_by_client = False
        self.counters = {"received": 0, "rejected": 0, "accepted": 0, "finished": 0, "disconnect_cancels": 0}
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # ZeroMQ drops (and disconnects) only beyond 4x the limit; frames in between get `frame_too_large`
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * config.max_frame_bytes)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.auth = None
        if config.curve_server_secret_file:
            self._enable_curve()
        self.sock.bind(config.address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.thread = threading.Thread(target=self._run, name="lockstep-frontend", daemon=True)

    def _enable_curve(self) -> None:
        from zmq.auth import load_certificate
        from zmq.auth.thread import ThreadAuthenticator

        if not self.config.curve_allowed_clients_dir:
            raise ValueError("[serve] curve_server_secret_file needs curve_allowed_clients_dir")
        public, secret = load_certificate(self.config.curve_server_secret_file)
        if secret is None:
            raise ValueError(f"{self.config.curve_server_secret_file} holds no secret key")
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=self.config.curve_allowed_clients_dir)
        self.sock.curve_secretkey, self.sock.curve_publickey = secret, public
        self.sock.curve_server = True

    def start(self) -> "Frontend":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        os.write(self.wake_w, b"x")
        self.thread.join(10)
        if self.auth is not None:
            self.auth.stop()

    # -------------------------------------------------------------- outputs from the manager's loop
    def deliver(self, out: GenerationOutput) -> None:
        """Called by the manager's loop thread for every output of a request this frontend owns."""
        self.outputs.append(out)
        try:
            os.write(self.wake_w, b"x")
        except BlockingIOError:  # the pipe is full: the frontend is already awake
            pass

    # -------------------------------------------------------------- the thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        next_sweep = time.monotonic() + 1.0
        while not self.stop_event.is_set():
            events = dict(poller.poll(500))
            if self.wake_r in events:
                os.read(self.wake_r, 65536)
            if self.sock in events:
                for _ in range(1000):  # drain, bounded so outputs are never starved
                    try:
                        frames = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_frames(frames)
            while self.outputs:
                self._send_output(self.outputs.popleft())
            if time.monotonic() > next_sweep:
                self._cancel_silent_clients()
                next_sweep = time.monotonic() + 1.0
        while self.outputs:  # what the loop produced before it stopped still goes out
            self._send_output(self.outputs.popleft())
        self.sock.close(linger=2000)

    def _send(self, ident: bytes, kind: str, **fields: Any) -> bool:
        try:
            self.sock.send_multipart([ident, P.encode(kind, **fields)])
            return True
        except zmq.ZMQError:  # the client is gone (ROUTER_MANDATORY): cancel what it asked for
            self._cancel_client(ident)
            return False

    def _on_frames(self, frames: list[bytes]) -> None:
        self.counters["received"] += 1
        ident = frames[0]
        self.last_seen[ident] = time.monotonic()
        if len(frames) != 2:
            self._reject(ident, P.ProtocolError(P.Code.BAD_FRAME, f"expected one frame, got {len(frames) - 1}"))
            return
        try:
            msg = P.decode(frames[1], self.config.max_frame_bytes)
            self._handle(ident, msg)
        except P.ProtocolError as e:
            self._reject(ident, e)
        except Exception as e:  # the front door must outlive any message
            log.exception("frontend: unexpected error")
            self._reject(ident, P.ProtocolError(P.Code.INTERNAL, f"{type(e).__name__}: {e}"))

    def _reject(self, ident: bytes, e: P.ProtocolError) -> None:
        self.counters["rejected"] += 1
        self._send(ident, P.REJECTED, mid=e.mid, code=e.code, message=e.message, request_id=e.request_id)

    def _handle(self, ident: bytes, msg: dict) -> None:
        kind, mid = msg["kind"], msg.get("mid")
        if kind == P.SUBMIT:
            self._submit(ident, P.parse_submit(msg))
        elif kind == P.CANCEL:
            rid = P.field(msg, "request_id", str, required=True)
            owner = self.owners.get(rid)
            if owner is None or owner.ident != ident:
                raise P.ProtocolError(P.Code.UNKNOWN_REQUEST, f"no request {rid!r} of yours is in flight", mid, rid)
            self.manager.cancel_request(rid)
            self._send(ident, P.REPLY, mid=mid, data={"cancelled": rid})
        elif kind in (P.PAUSE, P.RESUME):
            self.manager.hold_scheduling(kind == P.PAUSE)
            self._send(ident, P.REPLY, mid=mid, data={"paused": kind == P.PAUSE})
        elif kind == P.STATS:
            self._send(ident, P.REPLY, mid=mid, data=self.manager.stats() | {
                "frontend": dict(self.counters), "restart_count": getattr(self.manager, "restart_count", 0)})
        elif kind == P.HEALTH:
            self._send(ident, P.REPLY, mid=mid, data={
                "ok": self.manager.is_running(), "world_size": self.manager.groups.world_size,
                "restart_count": getattr(self.manager, "restart_count", 0), "failure": self.manager.failure})
        elif kind == P.UPDATE_WEIGHTS:
            from worker.weights import UpdateCall

            source = P.field(msg, "source", str, "checkpoint")
            kv_policy = P.field(msg, "kv_policy", str, "keep")
            if kv_policy not in ("keep", "recompute"):
                raise P.ProtocolError(P.Code.BAD_FIELD, "kv_policy must be 'keep' or 'recompute'", mid)
            if source == "checkpoint":
                call = UpdateCall(source, path=P.field(msg, "path", str, required=True), kv_policy=kv_policy)
            elif source == "push":
                call = UpdateCall(source, kv_policy=kv_policy, store=P.field(msg, "store", str, required=True),
                                  buckets=P.field(msg, "buckets", list, required=True))
            else:
                raise P.ProtocolError(P.Code.BAD_FIELD, f"unknown weight source {source!r}", mid)
            self.manager.update_weights_async(call, lambda r: self._reply_later(ident, mid, r))
        elif kind == P.BYE:
            self._cancel_client(ident)
        elif kind == P.PING:  # refreshes last_seen (above); the pong tells the client the server lives
            self._send(ident, P.PONG, mid=mid)

    def _reply_later(self, ident: bytes, mid: Any, result: dict) -> None:
        """A reply computed on another thread (weight updates): sent from this thread."""
        self.outputs.append(_Reply(ident, mid, result))  # type: ignore[arg-type]
        os.write(self.wake_w, b"x")

    def _submit(self, ident: bytes, s: P.Submit) -> None:
        rid = s.request_id or uuid.uuid4().hex
        ids = s.input_ids
        if ids is None:
            if self.tokenizer is None:
                raise P.ProtocolError(P.Code.NO_TOKENIZER, "this checkpoint has no tokenizer: send input_ids",
                                      s.mid, rid)
            ids = self.tokenizer(s.text)["input_ids"]
        if rid in self.owners:
            raise P.ProtocolError(P.Code.DUPLICATE_REQUEST_ID, f"request id {rid!r} is already in flight", s.mid, rid)
        self.owners[rid] = Owner(ident, s.streaming)
        self.manager.results.register(rid, self.deliver, None)
        try:
            self.manager.add_request(ids, request_id=rid, max_new_tokens=s.max_new_tokens, streaming=s.streaming,
                                     eos_token_id=s.eos_token_id, **s.sampling)
        except (ValueError, RuntimeError) as e:
            self.owners.pop(rid, None)
            self.manager.results.unregister(rid)
            text = str(e)
            code = next((c for needle, c in VALUE_ERROR_CODES if needle in text),
                        P.Code.QUEUE_FULL if "queue is full" in text else P.Code.BAD_FIELD)
            raise P.ProtocolError(code, text, s.mid, rid) from None
        self.counters["accepted"] += 1
        self._send(ident, P.ACCEPTED, mid=s.mid, request_id=rid)

    def _send_output(self, out: Any) -> None:
        if isinstance(out, _Reply):
            self._send(out.ident, P.REPLY, mid=out.mid, data=out.data)
            return
        owner = self.owners.get(out.request_id)
        if owner is None:
            return
        if out.is_finished():
            del self.owners[out.request_id]
            self.counters["finished"] += 1
            if out.status == RequestStatus.FAILED:
                code = P.Code.RANK_FAILED if self.manager.failure else P.Code.INTERNAL
                self._send(owner.ident, P.ERROR, request_id=out.request_id, code=code, message=out.error or "")
            else:
                self._send(owner.ident, P.FINAL, output=out.to_dict())
        elif owner.streaming:
            new = out.generated_tokens[owner.sent:]
            owner.sent = len(out.generated_tokens)
            self._send(owner.ident, P.TOKENS, request_id=out.request_id, tokens=new, index=owner.sent - len(new))

    def _cancel_client(self, ident: bytes) -> None:
        for rid, owner in list(self.owners.items()):
            if owner.ident == ident:
                self.manager.cancel_request(rid)
                del self.owners[rid]
                self.counters["disconnect_cancels"] += 1
        self.last_seen.pop(ident, None)

    def _cancel_silent_clients(self) -> None:
        limit = time.monotonic() - self.config.client_timeout_s
        busy = {o.ident for o in self.owners.values()}
        for ident, seen in list(self.last_seen.items()):
            if seen < limit:
                if ident in busy:
                    log.info("frontend: client %s went quiet; cancelling its requests", ident.hex())
                    self._cancel_client(ident)
                else:
                    del self.last_seen[ident]


@dataclass
class _Reply:
    ident: bytes
    mid: Any
    data: dict
