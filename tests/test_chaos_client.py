"""The client under faults, with a real `lockstep serve` at TP=2: a killed driver, a failing I/O thread, a
duplicate request id, close(), a refused weight update, a held pause (against a stand-in server)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from cluster import protocol as P
from cluster.client.client import AsyncClient, Client, ClientError
from cluster.errors import RequestLost
from cluster.outputs import RequestStatus
from launch.torchrun import free_port
from tests.client_procs import exit_or_sleep
from tests.clients import run_clients
from tests.conftest import REPO, hf_greedy
from tests.serving import fast_config, rank_pid, serve

CONFIG = fast_config(client_timeout_s=60.0)
LONG = 900  # tokens: a request that is still running when the test acts


@pytest.fixture(scope="module")
def server(make_checkpoint):
    with serve(make_checkpoint("llama"), tp=2, config=CONFIG) as s:
        yield s


def _ending(call) -> tuple[BaseException | None, float]:
    """Run `call` to its end: the exception it raised (None if it returned) and when it ended."""
    try:
        call()
        return None, time.monotonic()
    except BaseException as e:  # noqa: BLE001  (the test inspects whatever ended the call)
        return e, time.monotonic()


@pytest.mark.slow
def test_io_thread_exception_fails_every_waiting_call(server, monkeypatch):
    c = Client(server.address, timeout=30)
    rid = c.submit([1, 4, 4], max_new_tokens=LONG)
    stream = c.stream([1, 6, 6], max_new_tokens=LONG)
    next(stream)
    real, raised = P.decode_reply, []

    def decode_once_broken(*args, **kwargs):
        if not raised:
            raised.append(True)
            raise RuntimeError("injected decoding failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(P, "decode_reply", decode_once_broken)
    t0 = time.monotonic()
    with pytest.raises(ClientError) as e:
        c.result(rid, timeout=10)
    assert e.value.code == "client_failed" and "RuntimeError" in e.value.message, e.value
    with pytest.raises(ClientError) as e:
        for _ in stream:
            pass
    assert e.value.code == "client_failed", e.value
    assert time.monotonic() - t0 < 5.0
    assert raised
    # the next call opens a fresh I/O thread
    assert len(c.generate([1, 2, 3], max_new_tokens=2).generated_tokens) == 2
    c.close()


@pytest.mark.slow
def test_duplicate_request_id_keeps_the_original(server, make_checkpoint):
    prompt = [1, 3, 5, 7]
    with Client(server.address, timeout=60) as c:
        rejected = c.stats()["frontend"]["rejected"]
        c.submit(prompt, request_id="twice", max_new_tokens=12)
        with pytest.raises(ClientError) as e:
            c.submit([1, 2], request_id="twice", max_new_tokens=2)
        assert e.value.code == "duplicate_request_id"
        out = c.result("twice", timeout=60)
        assert c.stats()["frontend"]["rejected"] == rejected  # refused here, not by the server
    assert out.status == RequestStatus.FINISHED
    assert out.generated_tokens == hf_greedy(make_checkpoint("llama"), [prompt], 12)[0]


@pytest.mark.slow
def test_close_delivers_bye(server):
    """close() sends what was queued, the bye last, before it lets go of the socket, so the server cancels
    the client's requests at once (client_timeout_s is 60 s: only the bye can cancel them this soon): a
    connected client with a running request, and clients that close right after their first submit, before their
    connection is even up (today's LINGER=0 drops it, and the submit, more often than not)."""
    FRESH = 10
    with Client(server.address, timeout=30) as watcher:
        def counters() -> tuple[int, int, int]:
            s = watcher.stats()
            return s["frontend"]["accepted"], s["frontend"]["disconnect_cancels"], s["running"] + s["waiting"]

        accepted0, cancelled0, _ = counters()
        connected = Client(server.address, timeout=30)
        connected.submit([1, 8, 8], max_new_tokens=LONG)
        closed = time.monotonic()
        connected.close()
        for k in range(FRESH):
            fresh = Client(server.address, timeout=30)
            fresh.submit_future([1, 9, k], max_new_tokens=LONG)
            fresh.close()
        deadline = closed + 10
        while True:
            accepted, cancelled, busy = counters()
            accepted, cancelled = accepted - accepted0, cancelled - cancelled0
            if accepted == 1 + FRESH and cancelled == 1 + FRESH and busy == 0:
                break
            assert time.monotonic() < deadline, f"accepted {accepted}, cancelled {cancelled}, {busy} running"
            time.sleep(0.05)
        took = time.monotonic() - closed
        assert took < 2.0, took


@pytest.mark.slow
def test_close_ends_calls_still_waiting(server):
    c = Client(server.address, timeout=15)
    rid = c.submit([1, 9, 9], max_new_tokens=LONG)
    waiter: dict[str, tuple[BaseException | None, float]] = {}
    t = threading.Thread(target=lambda: waiter.setdefault("result", _ending(lambda: c.result(rid))))
    t.start()
    time.sleep(0.3)
    closed = time.monotonic()
    c.close()
    t.join(20)
    error, when = waiter["result"]
    assert isinstance(error, ClientError) and error.code == "client_closed", repr(error)
    assert when - closed < 2.0


@pytest.mark.slow
def test_refused_weight_update_raises(server, tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    with Client(server.address, timeout=60) as c:
        with pytest.raises(ClientError) as e:
            c.update_weights(missing)
        assert e.value.code == "weight_update_failed", e.value
        assert e.value.result.get("ok") is False and e.value.reason
        version = c.stats().get("weight_version")

    async def refused_async() -> ClientError:
        a = AsyncClient(server.address, timeout=60)
        try:
            with pytest.raises(ClientError) as e:
                await a.update_weights(missing)
            return e.value
        finally:
            await a.close()

    assert asyncio.run(refused_async()).code == "weight_update_failed"
    with Client(server.address, timeout=60) as c:
        assert c.stats().get("weight_version") == version  # nothing changed
        assert len(c.generate([1, 2, 3], max_new_tokens=2).generated_tokens) == 2


class StandInServer:
    """A ROUTER that answers pause/resume, ping, health and submit like the front door (each submit gets one
    token), counting the pings it gets. Changing `server_id` is a restart faster than the client's silence
    check: the same address answers again, but it no longer holds what the old server accepted."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.pings: list[float] = []
        self.server_id = "first"
        self.submits: list[dict] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, frame = self.sock.recv_multipart()
            msg = msgpack.unpackb(frame, raw=False)
            if msg["kind"] == P.PING:
                self.pings.append(time.monotonic())
                self.sock.send_multipart([ident, P.encode(P.PONG, mid=msg.get("mid"), server=self.server_id)])
            elif msg["kind"] == P.HEALTH:
                self.sock.send_multipart([ident, P.encode(P.REPLY, mid=msg["mid"], data={"ok": True})])
            elif msg["kind"] == P.SUBMIT:
                self.submits.append(msg)
                rid = msg["request_id"]
                start = len(msg.get("resume_tokens") or [])
                self.sock.send_multipart([ident, P.encode(P.ACCEPTED, mid=msg["mid"], request_id=rid,
                                                          server=self.server_id)])
                self.sock.send_multipart([ident, P.encode(P.TOKENS, request_id=rid, tokens=[40 + start],
                                                          index=start, versions=[])])
            elif msg["kind"] in (P.PAUSE, P.RESUME):
                self.sock.send_multipart([ident, P.encode(P.REPLY, mid=msg["mid"],
                                                          data={"paused": msg["kind"] == P.PAUSE})])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.mark.slow
def test_killed_driver_ends_every_waiting_call_with_server_gone(server):
    """After every other test of the shared server: it kills the server's driver."""
    # resume=False: this is the failure a client sees when it does not resume (tests/test_recovery_chaos.py)
    blocking, streaming = (Client(server.address, timeout=60, resume=False) for _ in range(2))
    rids = [blocking.submit([1, 5, k], max_new_tokens=LONG) for k in range(4)]
    stream = streaming.stream([1, 7, 7], max_new_tokens=LONG)
    assert len(next(stream).generated_tokens) == 1  # tokens are flowing
    deadline = time.monotonic() + 20  # bounds every wait (today's client would wait for `timeout`)
    ended: dict[str, tuple[BaseException | None, float]] = {}
    async_streaming = threading.Event()

    def wait_results() -> None:
        for r in rids:
            ended[r] = _ending(lambda r=r: blocking.result(r, timeout=max(0.1, deadline - time.monotonic())))

    def drain_stream() -> None:
        ended["stream"] = _ending(lambda: [None for _ in stream])

    async def drain_async_stream() -> None:
        c = AsyncClient(server.address, timeout=60, resume=False)
        items = c.stream([1, 6, 7], max_new_tokens=LONG)
        await items.__anext__()
        async_streaming.set()
        async for _ in items:
            pass

    def async_stream() -> None:
        ended["async stream"] = _ending(lambda: asyncio.run(asyncio.wait_for(
            drain_async_stream(), max(0.1, deadline - time.monotonic()))))

    threads = [threading.Thread(target=f, daemon=True) for f in (wait_results, drain_stream, async_stream)]
    for t in threads:
        t.start()
    assert async_streaming.wait(10)
    time.sleep(0.5)
    os.kill(rank_pid(server, 0), signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(30)
    assert set(ended) == {*rids, "stream", "async stream"}
    print("ended after the kill (s):", {name: round(when - killed, 2) for name, (_, when) in ended.items()})
    for name, (error, when) in ended.items():
        assert isinstance(error, ClientError) and error.code == "server_gone", (name, repr(error))
        assert server.address in error.message
        assert when - killed < 10.0, (name, when - killed)
    blocking.close()
    streaming.close()


@pytest.mark.slow
def test_a_held_pause_keeps_pinging():
    fake = StandInServer()
    try:
        c = Client(fake.address, timeout=10)
        c.pause()
        time.sleep(2.6)
        assert len(fake.pings) >= 2  # the pause is outstanding: the server must keep hearing from us
        c.resume()
        time.sleep(0.5)
        after = len(fake.pings)
        time.sleep(2.0)
        assert len(fake.pings) == after  # nothing outstanding any more: quiet
        c.close()
    finally:
        fake.close()


@pytest.mark.parametrize("resume", [False, True])
def test_a_server_restarted_at_the_same_address_loses_what_the_old_one_held(resume):
    """A group restarted within the silence check answers pings again at the same address; the client must
    still learn that the requests the old server accepted are gone (the pong names the server), not wait
    for them until its timeout."""
    fake = StandInServer()
    try:
        c = Client(fake.address, timeout=30, resume=resume)
        stream = c.stream([1, 2, 3], max_new_tokens=8)
        assert next(stream).generated_tokens == [40]
        t0 = time.monotonic()
        fake.server_id = "second"  # restarted: the next pong says so
        if not resume:
            with pytest.raises(RequestLost) as e:
                next(stream)
            assert e.value.code == "server_gone" and e.value.reason == RequestLost.RESUME_OFF, e.value
            assert "restarted" in e.value.message, e.value.message
        else:  # resubmitted to the new server with the token already delivered; the stream goes on
            assert next(stream).generated_tokens == [40, 41]
            assert fake.submits[-1]["resume_tokens"] == [40] and fake.submits[-1]["resumes"] == 1
        assert time.monotonic() - t0 < 4.0  # a ping or two, not the 30 s timeout
        c.close()
    finally:
        fake.close()


@pytest.mark.slow
def test_run_clients_fails_at_once_when_a_child_dies():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="exit code 3"):
        run_clients(exit_or_sleep, [(3,), (None,)], timeout=100)
    assert time.monotonic() - t0 < 60  # not the sleeper's 120 s nor the 100 s timeout


@pytest.mark.slow
def test_cli_reports_a_silent_server():
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "launch.cli", "health", "--address", address, "--server-timeout",
                          "1"], capture_output=True, text=True, timeout=60, check=False,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 2, out.stderr[-2000:]
    assert json.loads(out.stderr.strip().splitlines()[-1])["error"] == "server_gone"
    assert time.monotonic() - t0 < 30
