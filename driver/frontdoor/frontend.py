"""The front door on the driver: a ZeroMQ ROUTER socket in front of the manager, owned by one thread. Client
messages are decoded strictly (cluster/protocol.py): every bad one gets a `rejected` reply with a specific code.
Requests are the desk's (request_desk.py), sends never block (client_outbox.py), admin rights: admin.py."""

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
from cluster.config import PUSH_TIMEOUT_S
from cluster.errors import Code
from cluster.group_wire import check_group_bucket, check_group_call
from cluster.handle_wire import check_handles
from cluster.wake_pipe import WakePipe
from driver.frontdoor.admin import AdminPolicy, CurveKeys, PauseOwner
from driver.frontdoor.client_outbox import ClientOutbox
from driver.frontdoor.request_desk import ClientState, RequestDesk
from driver.frontdoor.served_weights import WeightsRecord
from driver.api.serving_metrics import metrics_map

log = logging.getLogger("lockstep")

@dataclass
class FrontendConfig:
    address: str = P.DEFAULT_ADDRESS
    max_frame_bytes: int = P.DEFAULT_MAX_FRAME_BYTES
    client_timeout_s: float = 30.0
    # CURVE: on when server_secret_file is set (a zmq certificate with the secret key); only clients whose public
    # certificates lie in allowed_clients_dir or admin_clients_dir get in (docs/protocol.md, "Admin operations")
    curve_server_secret_file: str | None = None
    curve_allowed_clients_dir: str | None = None
    curve_admin_clients_dir: str | None = None
    admin: bool = True  # false: pause/resume/update_weights are refused to everyone (admin_disabled)
    max_client_backlog: int = 4096  # messages waiting for a client that does not read; beyond: slow_client
    max_inflight_per_client: int = 4096  # accepted and unfinished requests of one client; beyond: client_limit
    push_timeout_s: float = PUSH_TIMEOUT_S  # a push's member silent this long: every rank gives up (docs/weights.md)


class Frontend:
    def __init__(self, manager: Any, config: FrontendConfig, tokenizer: Any = None, weights: Any = None,
                 model_path: str | None = None):
        """`weights`: the WeightsRecord (driver/frontdoor/served_weights.py) applied updates are written to;
        `model_path`: the checkpoint directory served (in `health`, for the HTTP gateway's tokenizer)."""
        self.manager, self.config, self.tokenizer = manager, config, tokenizer
        self.model_path = os.path.abspath(model_path) if model_path else None
        self.weights = weights if weights is not None else WeightsRecord(None)
        self.last_refused: dict[str, Any] | None = None  # the last refused weight update's result (in `stats`)
        self.replies: deque[tuple[bytes, Any, dict]] = deque()  # (ident, mid, data) from other threads, sent here
        self.waker = WakePipe()
        self.stop_event = threading.Event()
        self.counters = {"received": 0, "rejected": 0, "accepted": 0, "finished": 0, "disconnect_cancels": 0,
                         "slow_client_cancels": 0, "slow_client_overflows": 0, "loop_deadline_fails": 0,
                         "unreachable_clients": 0}
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # ZeroMQ drops (and disconnects) only beyond 4x the limit; frames in between get `frame_too_large`
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * config.max_frame_bytes)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.auth = None
        curve_keys = self._enable_curve() if config.curve_server_secret_file else None
        self.sock.bind(config.address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.admin = AdminPolicy(config.admin, self.address, curve_keys)
        self.pause = PauseOwner(manager.hold_scheduling)
        self.outbox = ClientOutbox(self.sock, config.max_client_backlog, self._on_overflow, self._on_unreachable)
        self.desk = RequestDesk(manager, config.max_inflight_per_client, self._send, self.outbox.send_if_possible,
                                self.waker.wake, self.counters, tokenizer)
        self.thread = threading.Thread(target=self._run, name="lockstep-frontend", daemon=True)

    def _enable_curve(self) -> CurveKeys:
        from zmq.auth import load_certificate
        from zmq.auth.thread import ThreadAuthenticator

        if not self.config.curve_allowed_clients_dir:
            raise ValueError("[serve] curve_server_secret_file needs curve_allowed_clients_dir")
        public, secret = load_certificate(self.config.curve_server_secret_file)
        if secret is None:
            raise ValueError(f"{self.config.curve_server_secret_file} holds no secret key")
        keys = CurveKeys(self.config.curve_allowed_clients_dir, self.config.curve_admin_clients_dir)
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve_callback(domain="*", credentials_provider=keys)
        self.sock.curve_secretkey, self.sock.curve_publickey = secret, public
        self.sock.curve_server = True
        return keys

    def start(self) -> "Frontend":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.waker.wake()
        self.thread.join(10)
        if not self.thread.is_alive():  # a thread still polling keeps its pipe
            self.waker.close()
        if self.auth is not None:
            self.auth.stop()

    # -------------------------------------------------------------- the thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.waker.fd, zmq.POLLIN)
        next_sweep = time.monotonic() + 1.0
        while not self.stop_event.is_set():
            try:
                self._turn(poller)
                if time.monotonic() > next_sweep:
                    next_sweep = time.monotonic() + 1.0
                    for ident in self.desk.silent_clients(self.config.client_timeout_s, self.pause.owner):
                        log.info("frontend: client %s went quiet; cancelling its requests", ident.hex())
                        self._drop_client(ident, "disconnect_cancels")
                    self.desk.check_loop()
            except Exception:  # the front door must outlive anything; the next turn goes on
                log.exception("frontend: unexpected error")
        self._drain_outputs()  # what the loop produced before it stopped still goes out
        deadline = time.monotonic() + 2.0
        while self.outbox.backlogs and time.monotonic() < deadline:
            self.outbox.flush()
            time.sleep(0.01)
        self.sock.close(linger=2000)

    def _turn(self, poller: zmq.Poller) -> None:
        """Read what clients sent, deliver what the loop produced, admit, and flush backlogs."""
        events = dict(poller.poll(20 if self.outbox.backlogs else 500))
        if self.waker.fd in events:
            self.waker.drain()
        if self.sock in events:
            for _ in range(1000):  # drain, bounded so outputs are never starved
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._on_frames(frames)
        self._drain_outputs()
        self.desk.admit()
        self.outbox.flush()

    def _send(self, ident: bytes, kind: str, **fields: Any) -> None:
        self.outbox.send(ident, P.encode(kind, **fields))

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        self.counters["received"] += 1
        ident = frames[0].bytes
        client = self.desk.client(ident)
        if len(frames) != 2:
            self._reject(ident, P.ProtocolError(Code.BAD_FRAME, f"expected one frame, got {len(frames) - 1}"))
            return
        try:
            msg = P.decode(frames[1].bytes, self.config.max_frame_bytes)
            self._handle(ident, client, msg, frames[1])
        except P.ProtocolError as e:
            self._reject(ident, e)
        except Exception as e:  # the front door must outlive any message
            log.exception("frontend: unexpected error")
            self._reject(ident, P.ProtocolError(Code.INTERNAL, f"{type(e).__name__}: {e}"))

    def _reject(self, ident: bytes, e: P.ProtocolError) -> None:
        self.counters["rejected"] += 1
        self._send(ident, P.REJECTED, mid=e.mid, code=e.code, message=e.message, request_id=e.request_id)

    def _handle(self, ident: bytes, client: ClientState, msg: dict, frame: zmq.Frame) -> None:
        kind, mid = msg["kind"], msg.get("mid")
        if kind in P.ADMIN_KINDS:
            self.admin.check(lambda: _user_id(frame), mid)
        if kind == P.SUBMIT:
            self._submit(ident, client, P.parse_submit(msg))
        elif kind == P.CANCEL:
            self.desk.cancel(ident, client, P.field(msg, "request_id", str, required=True), mid)
        elif kind == P.PAUSE:  # answered once the pause is in force (a mode "wait": once nothing runs)
            mode = P.pause_mode(msg)
            self.pause.pause(ident, mid, mode, lambda in_force: self._reply_later(ident, mid, {"paused": in_force,
                                                                                                "mode": mode}))
        elif kind == P.RESUME:
            self.pause.resume(ident, mid)
            self._send(ident, P.REPLY, mid=mid, data={"paused": False})
        elif kind == P.STATS:
            frontend = dict(self.counters, **self.desk.stats(), backlog=self.outbox.pending(),
                            paused=self.pause.owner is not None)
            self._send(ident, P.REPLY, mid=mid, data=self.manager.stats() | {
                "frontend": frontend, "restart_count": self.manager.restart_count,
                "weights": self.weights.current.report(), "metrics": metrics_map(self.manager),
                "last_refused_update": self.last_refused})
        elif kind == P.HEALTH:
            self._send(ident, P.REPLY, mid=mid, data={
                "ok": self.desk.loop_answers(), "world_size": self.manager.groups.world_size,
                "restart_count": self.manager.restart_count, "failure": self.manager.failure,
                "weights": self.weights.current.report(), "model": self.model_path,
                "model_name": os.path.basename(self.model_path) if self.model_path else None})
        elif kind == P.UPDATE_WEIGHTS:
            self._update_weights(ident, msg, mid)
        elif kind in (P.RELEASE_MEMORY, P.RESUME_MEMORY):
            self._memory_call(ident, msg, mid, kind)
        elif kind == P.WEIGHTS_GROUP:
            self._group_call(ident, msg, mid)
        elif kind == P.BYE:
            self._drop_client(ident, "disconnect_cancels")
        elif kind == P.PING:  # refreshes last_seen (above); the pong tells the client the server lives
            self._send(ident, P.PONG, mid=mid, server=self.desk.server_id)

    def _update_weights(self, ident: bytes, msg: dict, mid: Any) -> None:
        from worker.weights import UpdateCall

        source, kv_policy = P.field(msg, "source", str, "checkpoint"), P.field(msg, "kv_policy", str, "keep")
        partial = P.field(msg, "partial", bool, False)
        if kv_policy not in ("keep", "recompute"):
            raise P.ProtocolError(Code.BAD_FIELD, "kv_policy must be 'keep' or 'recompute'", mid)
        if source == "checkpoint":
            call = UpdateCall(source, path=P.field(msg, "path", str, required=True), kv_policy=kv_policy,
                              partial=partial)
        elif source == "push":  # every rank dials `store`: checked here, admins only (checked above)
            call = UpdateCall(source, kv_policy=kv_policy, store=P.check_store(msg.get("store"), mid),
                              buckets=P.check_buckets(msg.get("buckets"), mid), partial=partial,
                              timeout_s=self.config.push_timeout_s)
        elif source == "handles":  # every rank maps the trainer's segments: checked here, admins only
            buckets, handles = check_handles(msg.get("buckets"), msg.get("handles"), mid)
            call = UpdateCall(source, kv_policy=kv_policy, buckets=buckets, handles=handles, partial=partial)
        elif source == "group":  # a bucket over a trainer-owned group (cluster/group_wire.py); the driver's loop
            name, bucket, load_format, end = check_group_bucket(msg)  # decides whether the update ends with it
            call = UpdateCall(source, kv_policy=kv_policy, buckets=[bucket], group_name=name, load_format=load_format,
                              end=end, timeout_s=self.config.push_timeout_s)
        else:
            raise P.ProtocolError(Code.BAD_FIELD, f"unknown weight source {source!r}", mid)

        def done(result: dict) -> None:  # the loop thread: record what is served now, then answer
            if result.get("ok"):  # a partial update is restored by no checkpoint alone: recorded as not restorable
                if result.get("applied", True):  # (a trainer group's bucket that did not end its update: nothing)
                    self.weights.note_update("partial" if call.partial else source, call.path or None,
                                             result["version"])
            else:  # kept for `stats`: a trainer that died mid-push hears no answer, an operator still can
                self.last_refused = {k: result.get(k) for k in ("error", "rank", "reason_code", "tensor", "phase")}
            self._reply_later(ident, mid, result)

        self.manager.update_weights_async(call, done)

    def _memory_call(self, ident: bytes, msg: dict, mid: Any, kind: str) -> None:
        """release_memory / resume_memory on every rank through the loop (driver/api/memory_calls.py)."""
        from worker.memory_release import MemoryCall

        action = "release" if kind == P.RELEASE_MEMORY else "resume"
        call = MemoryCall(action, P.check_memory_tags(msg.get("tags"), mid),
                          P.field(msg, "keep_weights_on_host", bool, True))

        self.manager.memory.call_async(call, lambda result: self._reply_later(ident, mid, result))

    def _group_call(self, ident: bytes, msg: dict, mid: Any) -> None:
        """Join or leave a trainer's weight-sync group on every rank through the loop (driver/api/group_calls.py);
        every rank dials the trainer's address: checked here, admins only (checked above)."""
        from worker.trainer_group import GroupCall

        call = GroupCall(**check_group_call(msg, self.manager.groups.world_size), timeout_s=self.config.push_timeout_s)
        self.manager.group_calls.call_async(call, lambda result: self._reply_later(ident, mid, result))

    def _reply_later(self, ident: bytes, mid: Any, data: dict) -> None:
        """A reply from another thread (the loop's), sent from the front door's thread."""
        self.replies.append((ident, mid, data))
        self.waker.wake()

    # -------------------------------------------------------------- requests
    def _submit(self, ident: bytes, client: ClientState, s: P.Submit) -> None:
        s.request_id = s.request_id or uuid.uuid4().hex
        if s.wants_text and self.tokenizer is None:
            raise P.ProtocolError(Code.NO_TOKENIZER, "this checkpoint has no tokenizer: send input_ids, without "
                                  "stop or return_text", s.mid, s.request_id)
        ids = s.input_ids if s.input_ids is not None else self.tokenizer(s.text)["input_ids"]
        self.desk.submit(ident, client, s, ids)

    def _drain_outputs(self) -> None:
        while self.replies:
            ident, mid, data = self.replies.popleft()
            self._send(ident, P.REPLY, mid=mid, data=data)
        self.desk.drain_outputs()

    # -------------------------------------------------------------- clients that leave
    def _drop_client(self, ident: bytes, counter: str, last_code: str | None = None) -> int:
        """A client is gone: its requests are cancelled, what waits for it is dropped and its pause released."""
        self.outbox.drop(ident)
        self.pause.release(ident)
        return self.desk.drop_client(ident, counter, last_code)

    def _on_unreachable(self, ident: bytes) -> None:
        """ZeroMQ holds no connection to the client a reply is for (it closed its socket, or its connection broke
        and came back under a new identity): what waited for it is dropped and its requests are cancelled."""
        self.counters["unreachable_clients"] += 1
        n = self._drop_client(ident, "disconnect_cancels")
        log.info("frontend: client %s is unreachable; dropped what waited for it, cancelled its %d request(s)",
                 ident.hex(), n)

    def _on_overflow(self, ident: bytes) -> None:
        self.counters["slow_client_overflows"] += 1
        n = self._drop_client(ident, "slow_client_cancels", last_code=Code.SLOW_CLIENT)
        log.warning("frontend: client %s stopped reading (%d messages waiting); cancelled its %d request(s)",
                    ident.hex(), self.config.max_client_backlog, n)


def _user_id(frame: zmq.Frame) -> str | None:
    """The CURVE key (z85) ZeroMQ's authenticator attached to a message."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None
