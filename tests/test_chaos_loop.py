"""Chaos for the step loop, at TP=2 with real processes: heartbeats under a flooded inbox, the pause gate,
requests after a stop, a worker's weight-update call, a worker whose loop dies, a driver that fails alone,
and a worker stopped with SIGSTOP. Each of these failed on the code before milestone 2 (docs: the closing
note of issue 8)."""

from __future__ import annotations

import os
import signal
import time
from contextlib import suppress

import pytest

from cluster.client.client import Client, ClientError
from cluster.outputs import RequestStatus
from tests.conftest import hf_greedy, read_json, run_ranks
from tests.serving import fast_config, rank_pid, serve
from tests.workloads import mixed_prompts

FAST = fast_config(client_timeout_s=5.0)
NO_RESTART = ["--max-restarts", "0"]  # these watch the failure itself (its recovery: tests/test_recovery_chaos.py)


def run_scenarios(tmp_path, make_checkpoint, scenarios: str, env: dict | None = None, timeout: float = 240) -> tuple:
    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    base = tmp_path / "rec"
    proc = run_ranks("chaos_rank.py", [str(dir_a), str(dir_b), str(base), scenarios], timeout=timeout, env=env)
    assert os.path.exists(f"{base}.rank0"), proc.stdout[-4000:]
    return read_json(f"{base}.rank0"), read_json(f"{base}.rank1"), proc


@pytest.mark.slow
def test_manager_scenarios_at_tp2(tmp_path, make_checkpoint):
    rec, worker, proc = run_scenarios(tmp_path, make_checkpoint, "heartbeat,pause_gate,add_after_stop,pause_reentry,worker_call")
    log = proc.stdout[-4000:]
    # a held scheduler with a busy inbox still heartbeats: the workers outlive 3x their 2 s timeout
    hb = rec.get("heartbeat")
    assert hb and hb["flood"] > 50 and hb["status"] == RequestStatus.FINISHED, (hb, log)
    assert hb["tokens"] == hf_greedy(make_checkpoint("llama"), [mixed_prompts(2048)[3]], 4)[0]
    # a pause entered while no loop ran does not let a later pause release a rank before its caller came
    assert all(r.get("pause_gate_entered") and r.get("pause_gate_loop_alive") for r in (rec, worker)), log
    # a request after stop raises at once instead of waiting forever
    assert rec.get("add_after_stop") == "ManagerStopped" and rec["add_after_stop_s"] < 1.0, log
    # six pauses back to back, each running a collective inside: every entry gets a park of its own
    pr = rec.get("pause_reentry")
    assert pr and pr["done"] == 6 and worker.get("pause_reentry", {}).get("done") == 6, (pr, log)
    assert pr["tokens"] == hf_greedy(make_checkpoint("llama"), [mixed_prompts(2048)[3]], 4)[0]
    # the worker's tensors arrive after the driver's CALL: its loop is woken, not left to its 120 s timeout
    wc = worker.get("worker_call")
    assert wc and wc["ok"] and wc["seconds"] < 15, (wc, log)


@pytest.mark.slow
def test_worker_loop_death_names_the_rank(tmp_path, make_checkpoint):
    rec, worker, proc = run_scenarios(tmp_path, make_checkpoint, "worker_dies",
                                      env={"LOCKSTEP_FAULTS": "worker_execute:rank=1:step=6",
                                           "CHAOS_GROUP_TIMEOUT": "3"}, timeout=120)
    outs = rec.get("worker_dies")
    assert outs and all(o is not None for o in outs), proc.stdout[-4000:]
    assert all(o[0] == RequestStatus.FAILED and o[2] == "rank_failed" and "rank 1" in o[1] for o in outs), outs
    assert rec["worker_dies_s"] < 3.0 + 8  # the group's timeout plus the liveness watch, not the process's end
    assert "InjectedFault" in worker["worker_loop_error"]


@pytest.mark.slow
def test_driver_only_failure_stops_everyone_with_its_own_code(make_checkpoint, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_FAULTS", "driver_step:step=12")
    with serve(make_checkpoint("llama"), tp=2, config=FAST, extra=NO_RESTART) as s:
        c = Client(s.address, timeout=60, resume=False)
        rids = [c.submit([1, 5, k], max_new_tokens=200) for k in range(4)]
        errors = []
        for r in rids:
            with pytest.raises(ClientError) as e:
                c.result(r, timeout=30)
            errors.append(e.value)
        t0 = time.monotonic()
        assert all(e.code == "driver_failed" and "InjectedFault" in e.message for e in errors), errors[0]
        assert s.wait(15) != 0  # the driver exits non-zero, and the workers, told to STOP, do not linger
        assert time.monotonic() - t0 < 15
        c.close()


@pytest.mark.slow
def test_stopped_worker_is_named_within_the_timeout(make_checkpoint):
    with serve(make_checkpoint("llama"), tp=2, config=FAST, extra=NO_RESTART) as s:
        clients = [Client(s.address, timeout=60, resume=False) for _ in range(2)]
        rids = [[c.submit([1, 7, k], max_new_tokens=900) for k in range(3)] for c in clients]
        time.sleep(1.0)
        pid = rank_pid(s, 1)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            for c, ids in zip(clients, rids):
                for r in ids:
                    with pytest.raises(ClientError) as e:
                        c.result(r, timeout=30)
                    assert e.value.code == "rank_failed" and "rank 1" in e.value.message, e.value
            assert time.monotonic() - t0 < 5.0 + 5.0  # cpu_group_timeout plus a few seconds
        finally:
            with suppress(ProcessLookupError):  # the driver killed it (docs/recovery.md: a hung rank)
                os.kill(pid, signal.SIGCONT)
            for c in clients:
                c.close()


@pytest.mark.slow
def test_a_cancel_that_overtakes_its_add_ends_the_request_once(make_checkpoint):
    """Driver-local race, so in process at TP=1: the add is delayed on its way to the inbox (as a slow thread
    would be) and its cancel gets there first; the request must end once, CANCELLED, and never run."""
    import threading

    import cluster

    model = cluster.load(make_checkpoint("llama"))
    m = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(page_size=16))
    put = m.inbox.put

    def slow_add(item, *a, **k):
        if isinstance(item, tuple) and item[0] == "add":
            threading.Timer(0.3, put, (item,)).start()
        else:
            put(item, *a, **k)

    m.inbox.put = slow_add
    m.start()
    try:
        rid = m.add_request([1, 2, 3], max_new_tokens=5)
        m.cancel_request(rid)
        finals = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            out = m.get_result(rid, timeout=0.2)
            if out is not None and out.is_finished():
                finals.append(out)
        assert [o.status for o in finals] == [RequestStatus.CANCELLED], finals
        assert m.stats()["running"] == 0 and m.stats()["waiting"] == 0
    finally:
        m.stop()
        m.destroy()
