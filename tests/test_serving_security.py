"""Hostile input, CURVE authentication and a two-agent (multi-node style) launch, with real processes."""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from cluster import protocol as P
from cluster.client.client import Client, ClientError
from launch.torchrun import free_port
from tests.conftest import REPO, hf_greedy
from tests.serving import rank_pid, serve

SMALL_FRAMES = """
[continuous_batching]
page_size = 16
cpu_group_timeout = 10.0

[serve]
max_frame_bytes = 65536
"""


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


BAD_STORES = ["", "host", "host:", ":80", "host:0", "host:65536", "host:http", "host:-1", "a b:80", "host:+80",
              "evil.com:80/path", "[::1:80", "-bad-.com:80", "a..b:80", "x" * 300 + ":80", "host:٣", 5, None,
              ["h", 1], "host:99999999999999999999"]
BAD_BUCKETS = [None, "x", [], [[]], [["w", [2], "float32"]], [[["w", [-1], "float32"]]], [[["w", [2], "int8"]]],
               [[["w", [2.5], "float32"]]], [[["w", [True], "float32"]]], [[["", [2], "float32"]]],
               [[["w", [2], "float32", "extra"]]], [[["w", [2], "float32"], ["v", [2], "float16"]]],
               [[[1, [2], "float32"]]], [[["w", "2", "float32"]]], [[["w", [1 << 62], "float32"]]]]


def hostile_frames(rng: random.Random, n: int):
    """Malformed or hostile frames of many shapes, deterministic for a seed."""
    makers = [
        lambda: rng.randbytes(rng.randint(0, 64)),  # noise
        lambda: msgpack.packb([1, 2, 3]),  # not a map
        lambda: msgpack.packb({"v": 99, "kind": "submit"}),  # wrong version
        lambda: msgpack.packb({"v": 1, "kind": rng.choice(["", "drop_tables", "SUBMIT", 7])}),
        lambda: msgpack.packb({"v": 1, "kind": "submit", "input_ids": rng.choice(["x", [1.5], [None], {}, -1])}),
        lambda: msgpack.packb({"v": 1, "kind": "submit", "input_ids": [rng.randint(-10**9, 10**9)]}),
        lambda: msgpack.packb({"v": 1, "kind": "submit", "input_ids": []}),
        lambda: msgpack.packb({"v": 1, "kind": "submit", "input_ids": [1], "max_new_tokens": rng.choice([0, -1, 10**6])}),
        lambda: msgpack.packb({"v": 1, "kind": "submit", "input_ids": [1], "sampling": {"evil": 1}}),
        lambda: msgpack.packb({"v": 1, "kind": "cancel", "request_id": rng.randbytes(8).hex()}),
        lambda: msgpack.packb({1: 2, 3: 4}),  # non-string keys
        lambda: msgpack.packb({"v": 1, "kind": "submit", "input_ids": [1] * 70000}),  # over the frame limit
        lambda: b"\xc1" * rng.randint(1, 10),  # never-used msgpack byte
        lambda: msgpack.packb(msgpack.ExtType(5, b"boom")),
        lambda: b"\xdd\xff\xff\xff\xff",  # array header claiming 4G items
        lambda: msgpack.packb({"v": 1, "kind": "submit", "text": 5}),
        lambda: msgpack.packb({"v": 1, "kind": "update_weights", "path": 3}),
        # admin kinds (this loopback server makes the fuzzer an admin: they must be checked, never crash)
        lambda: msgpack.packb({"v": 1, "kind": rng.choice(["pause", "resume"]), "mid": rng.choice([1, "x", None])}),
        lambda: msgpack.packb({"v": 1, "kind": "update_weights", "source": rng.choice(["push", "ftp", 7, None]),
                               "kv_policy": rng.choice(["keep", "drop", 1])}),
        lambda: msgpack.packb({"v": 1, "kind": "update_weights", "source": "push",
                               "store": rng.choice(BAD_STORES), "buckets": [[["w", [2, 2], "float32"]]]}),
        lambda: msgpack.packb({"v": 1, "kind": "update_weights", "source": "push", "store": "127.0.0.1:1",
                               "buckets": rng.choice(BAD_BUCKETS)}),
        lambda: msgpack.packb({"v": 1, "kind": "cancel", "request_id": rng.choice([None, 5, [], "x" * 300])}),
        lambda: msgpack.packb({"v": 1, "kind": rng.choice(["stats", "health", "ping"]), "mid": {"a": 1}}),
    ]
    for _ in range(n):
        yield rng.choice(makers)()


@pytest.mark.slow
def test_fuzz_then_serve_correctly(make_checkpoint):
    model = make_checkpoint("llama")
    with serve(model, tp=2, config=SMALL_FRAMES) as s:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(s.address)
        driver = rank_pid(s, 0)
        rng = random.Random(1234)
        sent = replies = 0
        codes: dict[str, int] = {}
        internal = []
        warmup, total = 2000, 10_000
        rss_after_warmup = None

        def take(frame: bytes) -> None:
            msg = P.decode_reply(frame)
            codes[msg.get("code")] = codes.get(msg.get("code"), 0) + 1
            if msg.get("code") == "internal":
                internal.append(msg)

        for i, frame in enumerate(hostile_frames(rng, total)):
            if i % 7 == 0:
                sock.send_multipart([frame, b"extra frame"])  # multi-frame messages too
            else:
                sock.send(frame)
            sent += 1
            if i % 50 == 0:
                sock.poll(2000)  # let the server keep up
            while sock.poll(0):
                take(sock.recv())
                replies += 1
            if i == warmup:
                rss_after_warmup = rss_kib(driver)
        sock.send(P.encode(P.RESUME, mid="last"))  # the fuzzer may hold the pause: it lets go
        sent += 1
        deadline = time.monotonic() + 30
        while replies < sent and time.monotonic() < deadline:
            if sock.poll(1000):
                take(sock.recv())
                replies += 1
        assert replies == sent  # every hostile frame got its answer
        assert not internal, internal[:3]  # nothing a client sends is an internal error
        for code in ("bad_frame", "bad_version", "unknown_kind", "bad_field", "empty_prompt", "token_out_of_vocab",
                     "bad_max_new_tokens", "unknown_request", "frame_too_large"):
            assert code in codes, (code, codes)
        growth = rss_kib(driver) - rss_after_warmup
        assert growth / (total - warmup) < 2, f"driver grew by {growth} KiB over {total - warmup} hostile frames"
        prompt = [5, 6, 7, 8, 9]
        with Client(s.address) as c:
            assert c.generate(prompt, max_new_tokens=16).generated_tokens == hf_greedy(model, [prompt], 16)[0]
            assert c.stats()["frontend"]["requests"] == 0
        ctx.destroy(0)


@pytest.mark.slow
def test_curve_admits_only_allowed_clients_and_admins_alone_pause(make_checkpoint, tmp_path):
    from zmq.auth import create_certificates, load_certificate

    keys, allowed, admins = tmp_path / "keys", tmp_path / "allowed", tmp_path / "admins"
    for d in (keys, allowed, admins):
        d.mkdir()
    server_pub, server_secret = create_certificates(keys, "server")
    client_pub, client_secret = create_certificates(keys, "client")
    admin_pub, admin_secret = create_certificates(keys, "admin")
    create_certificates(keys, "stranger")
    os.replace(client_pub, allowed / "client.key")
    os.replace(admin_pub, admins / "admin.key")  # admins are admitted without being in the allowed folder
    config = (f"[continuous_batching]\npage_size = 16\ncpu_group_timeout = 5.0\n\n"
              f"[serve]\ncurve_server_secret_file = '{server_secret}'\n"
              f"curve_allowed_clients_dir = '{allowed}'\ncurve_admin_clients_dir = '{admins}'\n")
    with serve(make_checkpoint("llama"), tp=2, config=config) as s:
        server_key = load_certificate(server_pub)[0]

        def client(secret, timeout=30):
            return Client(s.address, server_key=server_key, client_keys=load_certificate(secret), timeout=timeout)

        good, admin, admin2 = client(client_secret), client(admin_secret), client(admin_secret)
        assert good.generate([1, 2, 3], max_new_tokens=3).status == 3
        for call in (good.pause, good.resume, lambda: good.update_weights("/nonexistent")):
            with pytest.raises(ClientError) as e:
                call()
            assert e.value.code == "admin_required"
        with pytest.raises(ClientError) as e:  # the push source is admin-only, checked before its fields
            good._wait(good.io.call(P.UPDATE_WEIGHTS, source="push", store="10.0.0.1:80", buckets=[]))
        assert e.value.code == "admin_required"
        with pytest.raises(ClientError) as e:  # and validated for admins
            admin._wait(admin.io.call(P.UPDATE_WEIGHTS, source="push", store="evil host:80",
                                      buckets=[[["w", [2], "float32"]]]))
        assert e.value.code == "bad_field"

        admin.pause()
        admin.pause()  # the owner may pause again
        for call in (admin2.resume, admin2.pause):  # another admin may not take it over
            with pytest.raises(ClientError) as e:
                call()
            assert e.value.code == "not_pause_owner"
        rid = good.submit([1, 2, 3], max_new_tokens=3)
        with pytest.raises(TimeoutError):
            good.result(rid, timeout=1.5)  # held
        admin.close()  # its bye releases the pause
        assert good.result(rid, timeout=30).status == 3
        admin2.pause()
        admin2.resume()
        good.close()
        admin2.close()

        stranger = client(keys / "stranger.key_secret", timeout=3)
        with pytest.raises(TimeoutError):
            stranger.health(timeout=3)
        stranger.close()
        plain = Client(s.address, timeout=3)  # no CURVE at all
        with pytest.raises(TimeoutError):
            plain.health(timeout=3)
        plain.close()


def test_admin_needs_a_local_bind_without_curve():
    from driver.frontdoor.admin import binds_locally

    for address in ("tcp://127.0.0.1:5555", "tcp://127.3.2.1:1", "tcp://localhost:80", "tcp://[::1]:5555",
                    "ipc:///tmp/lockstep.sock"):
        assert binds_locally(address), address
    for address in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://eth0:5555",
                    "tcp://[::]:5555", "tcp://example.com:5555", "inproc://x"):
        assert not binds_locally(address), address


@pytest.mark.slow
def test_two_launcher_agents_serve(make_checkpoint):
    """`lockstep serve --nnodes 2`: two agents on this machine, one rank each, c10d rendezvous."""
    model = make_checkpoint("qwen2")
    address = f"tcp://127.0.0.1:{free_port()}"
    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs, ready = [], queue.Queue()
    for node in range(2):
        p = subprocess.Popen([sys.executable, "-m", "launch.cli", "serve", "--model", str(model), "--tp", "1",
                              "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", endpoint,
                              "--address", address], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=REPO, env=env, start_new_session=True)
        procs.append(p)

        def pump(p=p):
            for line in p.stdout:
                if line.startswith("ready "):
                    ready.put(line.split()[1])
        threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.get(timeout=180) == address
        prompts = [[1, 4, 9, 16, 25], [1, 8, 27, 64]]
        with Client(address, timeout=120) as c:
            assert c.health()["world_size"] == 2
            got = [c.generate(p, max_new_tokens=12).generated_tokens for p in prompts]
        assert got == [t[:12] for t in hf_greedy(model, prompts, 12)]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
