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
from cluster.client import Client
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
    ]
    for _ in range(n):
        yield rng.choice(makers)()


def test_fuzz_then_serve_correctly(make_checkpoint, tmp_path):
    model = make_checkpoint("llama")
    with serve(model, tp=1, config=SMALL_FRAMES, tmp_path=tmp_path) as s:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(s.address)
        driver = rank_pid(s, 0)
        rng = random.Random(1234)
        sent = replies = 0
        codes = set()
        rss_after_warmup = None
        for i, frame in enumerate(hostile_frames(rng, 10_000)):
            if i % 7 == 0:
                sock.send_multipart([frame, b"extra frame"])  # multi-frame messages too
            else:
                sock.send(frame)
            sent += 1
            if i % 50 == 0:
                sock.poll(2000)  # let the server keep up
            while sock.poll(0):
                codes.add(P.decode_reply(sock.recv()).get("code"))
                replies += 1
            if i == 2000:
                rss_after_warmup = rss_kib(driver)
        deadline = time.monotonic() + 30
        while replies < sent and time.monotonic() < deadline:
            if sock.poll(1000):
                codes.add(P.decode_reply(sock.recv()).get("code"))
                replies += 1
        assert replies == sent  # every hostile frame got its rejection
        for code in ("bad_frame", "bad_version", "unknown_kind", "bad_field", "empty_prompt", "token_out_of_vocab",
                     "bad_max_new_tokens", "unknown_request", "frame_too_large"):
            assert code in codes, (code, codes)
        growth = rss_kib(driver) - rss_after_warmup
        assert growth < 64 * 1024, f"driver grew by {growth} KiB over 8,000 hostile frames"
        prompt = [5, 6, 7, 8, 9]
        with Client(s.address) as c:
            assert c.generate(prompt, max_new_tokens=16).generated_tokens == hf_greedy(model, [prompt], 16)[0]
        ctx.destroy(0)


def test_curve_admits_only_allowed_clients(make_checkpoint, tmp_path):
    from zmq.auth import create_certificates, load_certificate

    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_pub, server_secret = create_certificates(keys, "server")
    client_pub, client_secret = create_certificates(keys, "client")
    create_certificates(keys, "stranger")
    os.replace(client_pub, allowed / "client.key")
    config = (f"[serve]\ncurve_server_secret_file = '{server_secret}'\n"
              f"curve_allowed_clients_dir = '{allowed}'\n")
    with serve(make_checkpoint("llama"), tp=1, config=config, tmp_path=tmp_path) as s:
        server_key = load_certificate(server_pub)[0]
        good = Client(s.address, server_key=server_key, client_keys=load_certificate(client_secret), timeout=30)
        assert good.generate([1, 2, 3], max_new_tokens=3).status == 3
        good.close()
        stranger = Client(s.address, server_key=server_key,
                          client_keys=load_certificate(keys / "stranger.key_secret"), timeout=3)
        with pytest.raises(TimeoutError):
            stranger.health(timeout=3)
        stranger.close()
        plain = Client(s.address, timeout=3)  # no CURVE at all
        with pytest.raises(TimeoutError):
            plain.health(timeout=3)
        plain.close()


def test_two_launcher_agents_serve(make_checkpoint, tmp_path):
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
