"""End to end with real processes: `lockstep serve` at TP=2 on the CPU, clients in other processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from cluster.client.client import AsyncClient, Client, ClientError
from cluster.outputs import RequestStatus
from tests.client_procs import abandon, hammer
from tests.clients import run_clients
from tests.conftest import REPO, hf_greedy
from tests.serving import fast_config, rank_pid, serve
from tests.workloads import mixed_prompts

FAST = fast_config(client_timeout_s=2.0)


@pytest.fixture(scope="module")
def server(make_checkpoint):
    # without a tokenizer (same weights as make_checkpoint("llama")): text submits are refused with no_tokenizer;
    # no restart: the module's last test kills a rank and watches the server end
    with serve(make_checkpoint("llama", tokenizer=False), tp=2, config=FAST, extra=["--max-restarts", "0"]) as s:
        yield s


@pytest.mark.slow
def test_outputs_match_transformers(server, make_checkpoint):
    prompts = mixed_prompts(2048)
    with Client(server.address) as c:
        rids = [c.submit(p, max_new_tokens=32) for p in prompts]
        got = [c.result(r).generated_tokens for r in rids]
    assert got == hf_greedy(make_checkpoint("llama"), prompts)


@pytest.mark.slow
def test_streaming_and_cancel(server, make_checkpoint):
    prompt = mixed_prompts(2048)[6]
    with Client(server.address) as c:
        outs = list(c.stream(prompt, max_new_tokens=10))
        assert [len(o.generated_tokens) for o in outs] == list(range(1, 11))
        assert outs[-1].status == RequestStatus.FINISHED
        assert outs[-1].generated_tokens == hf_greedy(make_checkpoint("llama"), [prompt])[0][:10]
        rid = c.submit(prompt, max_new_tokens=900)
        time.sleep(0.3)
        c.cancel(rid)
        out = c.result(rid, timeout=30)
        assert out.status == RequestStatus.CANCELLED and len(out.generated_tokens) < 900


@pytest.mark.slow
def test_async_client(server, make_checkpoint):
    import asyncio

    prompts, streamed_prompt, n = [[1, 9, k] for k in range(20)], [1, 2], 3

    async def go():
        c = AsyncClient(server.address, timeout=120)
        outs = await asyncio.gather(*[c.generate(p, max_new_tokens=n) for p in prompts])
        streamed = [o async for o in c.stream(streamed_prompt, max_new_tokens=n)]
        await c.close()
        return outs, streamed

    outs, streamed = asyncio.run(go())
    want = hf_greedy(make_checkpoint("llama"), prompts + [streamed_prompt], n)
    assert [o.generated_tokens for o in outs] == want[:-1]
    assert [o.generated_tokens for o in streamed] == [want[-1][:k] for k in range(1, n + 1)]
    assert streamed[-1].status == RequestStatus.FINISHED


@pytest.mark.slow
def test_disconnected_client_is_cancelled(server):
    p = mp.get_context("spawn").Process(target=abandon, args=(server.address,))
    p.start()
    p.join(60)
    with Client(server.address) as c:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            s = c.stats()
            if s["frontend"]["disconnect_cancels"] >= 1 and s["running"] == 0:
                break
            time.sleep(0.5)
        assert s["frontend"]["disconnect_cancels"] >= 1
        assert s["running"] == 0 and s["free_blocks"] == s["num_blocks"]


@pytest.mark.slow
def test_thousand_requests_from_eight_clients(server):
    done = run_clients(hammer, [(server.address, k, 125) for k in range(8)], timeout=600)
    assert done == [125] * 8


@pytest.mark.slow
@pytest.mark.parametrize("payload,code", [
    ({"input_ids": []}, "empty_prompt"),
    ({"input_ids": [1, 99999]}, "token_out_of_vocab"),
    ({"input_ids": [1] * 1024}, "prompt_too_long"),
    ({"input_ids": [1, 2], "max_new_tokens": 0}, "bad_max_new_tokens"),
    ({"input_ids": [1, 2], "max_new_tokens": -5}, "bad_max_new_tokens"),
    ({"input_ids": [1, 2], "max_new_tokens": 5000}, "bad_max_new_tokens"),
    ({"input_ids": "1,2"}, "bad_field"),
    ({"input_ids": [1, 2], "sampling": {"temperature": "hot"}}, "bad_field"),
    ({"text": "hello"}, "no_tokenizer"),
    ({"input_ids": [1, 2], "stop": ["x"]}, "no_tokenizer"),
])
def test_bad_submits_are_rejected_with_codes(server, payload, code):
    with Client(server.address) as c:
        with pytest.raises(ClientError) as e:
            c.generate(payload.pop("input_ids", None), **payload)
        assert e.value.code == code, e.value
        assert len(c.generate([1, 2, 3], max_new_tokens=2).generated_tokens) == 2  # still serving


@pytest.mark.slow
def test_duplicate_request_id(server):
    with Client(server.address) as c:
        c.submit([1, 2, 3], request_id="dup", max_new_tokens=200)
        with pytest.raises(ClientError) as e:
            c.submit([1, 2, 3], request_id="dup", max_new_tokens=2)
        assert e.value.code == "duplicate_request_id"
        c.cancel("dup")


@pytest.mark.slow
def test_pause_resume_and_health(server, make_checkpoint):
    """A held request waits without producing a token; its tokens all come after resume."""
    import threading

    prompt = [1, 2, 3]
    with Client(server.address, timeout=60) as c:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and c.stats()["running"] + c.stats()["waiting"]:
            time.sleep(0.1)  # earlier tests' cancelled requests are gone
        c.pause()
        time.sleep(0.3)  # a step already under way when the pause came ends
        before = c.stats()
        items: list[tuple[float, object]] = []  # (arrival time, streamed output)
        streaming = threading.Thread(target=lambda: items.extend(
            (time.monotonic(), o) for o in c.stream(prompt, max_new_tokens=5)), daemon=True)
        streaming.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and c.stats()["waiting"] != 1:
            time.sleep(0.1)
        time.sleep(1.0)  # a running request would have streamed tokens by now
        held = c.stats()
        assert held["waiting"] == 1 and held["running"] == 0, held
        assert held["tokens_generated"] == before["tokens_generated"] and held["step"] == before["step"], held
        assert items == []  # no `tokens` message while held
        resumed_at = time.monotonic()
        c.resume()
        streaming.join(30)
        assert [len(o.generated_tokens) for _, o in items] == [1, 2, 3, 4, 5]  # the last is the final
        assert all(t >= resumed_at for t, _ in items)
        assert items[-1][1].status == RequestStatus.FINISHED
        assert items[-1][1].generated_tokens == hf_greedy(make_checkpoint("llama"), [prompt], 5)[0]
        h = c.health()
        assert h["ok"] and h["world_size"] == 2 and h["restart_count"] == 0


@pytest.mark.slow
def test_cli_submit_and_stats(server):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "launch.cli", "submit", "--address", server.address, "--input-ids",
                          "1,5,9", "--max-new-tokens", "3"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert '"generated_tokens"' in out.stdout
    out = subprocess.run([sys.executable, "-m", "launch.cli", "stats", "--address", server.address],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and '"step"' in out.stdout


@pytest.mark.slow
def test_the_router_in_front_of_two_replicas(server):
    """The replicas' router (launch/router/), in this process, in front of the shared server twice over: what
    it routes equals what the server answers directly, streams arrive token by token, health and stats speak for
    both replicas, and a prompt's second submit follows its prefix to the replica that holds it."""
    from launch.router.router import Router, RouterConfig

    prompt = mixed_prompts(2048)[7]
    with Client(server.address) as direct:
        want = direct.generate(prompt, max_new_tokens=8).generated_tokens
    router = Router([server.address, server.address], RouterConfig(address="tcp://127.0.0.1:*", page_size=16)).start()
    try:
        with Client(router.address) as c:
            assert c.generate(prompt, max_new_tokens=8).generated_tokens == want
            outs = list(c.stream(prompt, max_new_tokens=5))
            assert [len(o.generated_tokens) for o in outs] == [1, 2, 3, 4, 5] and outs[-1].generated_tokens == want[:5]
            health = c.health()
            assert health["ok"] and health["router"] and len(health["replicas"]) == 2
            stats = c.stats()
            assert len(stats["replicas"]) == 2 and stats["router"]["policy"] == "affinity"
            assert stats["router"]["prefix_routed"] >= 1 and stats["router"]["affinity_entries"] >= 1
    finally:
        router.close()


@pytest.mark.slow
def test_killed_worker_fails_every_request_naming_it(server):
    """Last in the module: it ends the shared server. No restart (the server's --max-restarts 0), no resume: the
    failure itself (its recovery: tests/test_recovery_chaos.py)."""
    c = Client(server.address, timeout=60, resume=False)
    rids = [c.submit([1, 5, k], max_new_tokens=900) for k in range(6)]
    time.sleep(1.0)
    os.kill(rank_pid(server, 1), signal.SIGKILL)
    t0 = time.monotonic()
    errors = []
    for r in rids:
        with pytest.raises(ClientError) as e:
            c.result(r)
        errors.append(e.value)
    took = time.monotonic() - t0
    assert all(e.code == "rank_failed" and "rank 1" in e.message for e in errors), [(type(e).__name__, e.code,
                                                                                      e.message) for e in errors]
    assert took < 5.0  # within cpu_group_timeout
    assert server.wait(60) != 0
    assert "exitcode  : 3" in server.log or "exitcode: 3" in server.log
