"""Issue 13: data-parallel replicas on Ray behind one router (launch/router/replicas.py, launch/router/router.py).

On the local Ray the Ray modules share (tests/ray_session.py: 4 CPUs, the dashboard), 2 replicas of TP=1 behind
one address: REQUESTS requests from CLIENTS clients (half streaming) all token-identical to transformers' greedy
generate; one replica's actor killed with ray.kill mid-load: every request still completes, token-identical (resumed
on the other replica), and the dead replica comes back and is taken in again; a weight update across both replicas
under load loses no request and leaves both on the new version; a bad checkpoint changes neither; shared-prefix
prompts go to the replica holding the prefix (the router's and the replicas' own prefix counters show it). Last, a
TP=2 replica next to a TP=1 one behind one router: MIXED_REQUESTS requests, all exact, both routed (the main test's
checks on a smaller load: its TP=2 replica serves several times slower here).
"""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")

from cluster.client.client import Client, WeightUpdateError  # noqa: E402
from launch.torchrun import free_port  # noqa: E402
from cluster.outputs import RequestStatus  # noqa: E402
from launch.router.replicas import start_replicas  # noqa: E402
from tests.conftest import REPO, hf_greedy  # noqa: E402
from tests.ray_session import wait_until  # noqa: E402
from tests.workloads import mixed_prompts, shared_prefix_prompts  # noqa: E402

REQUESTS = 500  # the count
MIXED_REQUESTS = 64  # the TP=2 + TP=1 fleet's: two rounds of the clients' 32 in flight
CLIENTS = 4
NEW = 8
PAGE = 16
SERVICE = "lockstep-test-replicas"
# cpu_group_timeout: as tests/test_ray.py's (a rank actor starved on a busy machine)
PRESET = {"continuous_batching": {"page_size": PAGE, "max_batch_tokens": 256, "max_requests_per_batch": 64,
                                  "cpu_group_timeout": 15.0},
          "serve": {"client_timeout_s": 10.0},
          "router": {"health_every_s": 0.3, "server_timeout_s": 3.0}}


def prompts() -> list[list[int]]:
    return mixed_prompts(2048)[:12]


@pytest.fixture(scope="module")
def fleet(ray_module, make_checkpoint):
    handle = start_replicas(make_checkpoint("llama"), tp=1, replicas=2, config=PRESET, address="tcp://127.0.0.1:*",
                            ready_timeout=300, service_name=SERVICE)
    try:
        yield handle
    finally:
        handle.shutdown()


def run_load(address: str, n: int = REQUESTS, tag: str = "r") -> dict[str, dict]:
    """`n` requests over CLIENTS clients (8 at a time each; odd ones streaming): per request id its prompt index,
    final tokens, status, and whether its stream delivered every token once, in order (or its error)."""
    results: dict[str, dict] = {}
    ps = prompts()

    def one(c: Client, i: int) -> None:
        rid, k = f"{tag}{i}", i % len(ps)
        try:
            if i % 2:
                seen: list[int] = []
                ok = True
                for out in c.stream(ps[k], request_id=rid, max_new_tokens=NEW):
                    ok &= out.generated_tokens[:len(seen)] == seen and len(out.generated_tokens) > len(seen)
                    seen = out.generated_tokens
            else:
                out, ok = c.generate(ps[k], request_id=rid, max_new_tokens=NEW), True
            results[rid] = {"prompt": k, "tokens": out.generated_tokens, "status": out.status, "stream_ok": ok,
                            "versions": out.weight_versions}
        except Exception as e:  # noqa: BLE001  (reported per request, so the test says which failed)
            results[rid] = {"prompt": k, "error": f"{type(e).__name__}: {e}", "status": None}

    def client(no: int) -> None:
        with Client(address, timeout=180, resume_timeout_s=120) as c, ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: one(c, i), range(no, n, CLIENTS)))

    threads = [threading.Thread(target=client, args=(no,)) for no in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def assert_all_exact(results: dict[str, dict], model_dir, n: int = REQUESTS) -> None:
    want = hf_greedy(model_dir, prompts(), NEW)
    failed = {rid: r["error"] for rid, r in results.items() if "error" in r}
    assert not failed, f"{len(failed)} requests failed, e.g. {sorted(failed.items())[:2]}"
    assert len(results) == n
    for rid, r in results.items():
        assert r["status"] == RequestStatus.FINISHED and r["stream_ok"], (rid, r)
        assert r["tokens"] == want[r["prompt"]], rid


@pytest.mark.slow
def test_many_requests_from_several_clients_match_transformers(fleet, make_checkpoint):
    results = run_load(fleet.address)
    assert_all_exact(results, make_checkpoint("llama"))
    with fleet.client() as c:
        stats, health = c.stats(), c.health()
    assert health["ok"] and [r["healthy"] for r in health["replicas"]] == [True, True]
    # both served: the router sends by load, so a replica slowed by a busy machine takes fewer (a fresh clone's run
    # with four workers on two cores routed under a quarter to one); a tenth is still both replicas serving
    assert all(r["routed"] >= REQUESTS // 10 for r in stats["replicas"]), [r["routed"] for r in stats["replicas"]]
    assert stats["router"]["finished"] >= REQUESTS and stats["tokens_generated"] >= REQUESTS * NEW
    assert sum(r["stats"]["tokens_generated"] for r in stats["replicas"]) == stats["tokens_generated"]


@pytest.mark.slow
def test_the_http_gateway_in_front_of_the_router(fleet, make_checkpoint):
    """One front door over HTTP too (`lockstep serve --replicas R --http ...` runs this gateway): text, streamed
    text with logprobs and stop strings pass through the router as through one driver."""
    import openai
    from transformers import AutoTokenizer

    from launch.gateway.server import Gateway, settings_for

    model_dir = make_checkpoint("llama")
    tok = AutoTokenizer.from_pretrained(model_dir)
    ps = prompts()[:3]
    want = [tok.decode(t, skip_special_tokens=True) for t in hf_greedy(model_dir, ps, NEW)]
    gateway = Gateway(fleet.address, f"127.0.0.1:{free_port()}", settings_for(str(model_dir), None, {})).start_thread()
    try:
        oai = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for p, text in zip(ps, want):
            assert oai.completions.create(model=model_dir.name, prompt=p, max_tokens=NEW,
                                          temperature=0).choices[0].text == text
        chunks = list(oai.completions.create(model=model_dir.name, prompt=ps[1], max_tokens=NEW, temperature=0,
                                             stream=True, logprobs=1))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want[1]
        assert sum(len(c.choices[0].logprobs.token_logprobs) for c in chunks if c.choices and c.choices[0].logprobs) \
            == len(hf_greedy(model_dir, [ps[1]], NEW)[0])
        stop = want[2][len(want[2]) // 2:][:2]
        assert stop.strip(), want[2]
        cut = oai.completions.create(model=model_dir.name, prompt=ps[2], max_tokens=NEW, temperature=0, stop=[stop])
        assert cut.choices[0].text == want[2][:want[2].find(stop)] and cut.choices[0].finish_reason == "stop"
        # metrics: one series per replica on /metrics, their sum in the router's stats
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(gateway.url + "/metrics", timeout=30) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        per_replica = {s.labels["replica"]: s.value for s in families["lockstep:generation_tokens"].samples
                       if s.name.endswith("_total")}
        with fleet.client() as c:
            stats = c.stats()
        assert set(per_replica) == {"0", "1"} and all(v > 0 for v in per_replica.values()), per_replica
        assert stats["metrics"]["generation_tokens"] >= sum(per_replica.values())  # counted at least as late
        assert stats["metrics"]["generation_tokens"] == sum(
            r["stats"]["metrics"]["generation_tokens"] for r in stats["replicas"])
        ttft = stats["metrics"]["time_to_first_token_seconds"]
        assert ttft["count"] == sum(r["stats"]["metrics"]["time_to_first_token_seconds"]["count"]
                                    for r in stats["replicas"]) == ttft["buckets"][-1][1]
    finally:
        gateway.stop()


@pytest.mark.slow
def test_prefix_affinity_routes_a_shared_prefix_to_one_replica(fleet):
    """4 families of 4 prompts sharing 100 to 250 tokens, one at a time: each family's first prompt goes to the
    least loaded replica, the other three follow it there and reuse its cached pages."""
    with fleet.client() as c:
        before = c.stats()
        for p in shared_prefix_prompts(2048):
            c.generate(p, max_new_tokens=2)
        after = c.stats()
    routed = after["router"]["prefix_routed"] - before["router"]["prefix_routed"]
    hits = after["prefix_hit_blocks"] - before["prefix_hit_blocks"]
    assert routed == 12, (before["router"], after["router"])
    shared_pages = sum((100 + 50 * fam) // PAGE for fam in range(4)) * 3
    assert hits >= shared_pages, (hits, shared_pages)


@pytest.mark.slow
def test_a_killed_replica_costs_no_request_and_comes_back(fleet, make_checkpoint):
    group = fleet.groups[0]
    done: list[str] = []

    def kill_when_busy() -> None:
        with Client(group.address, resume=False) as c:
            start, deadline = c.stats()["tokens_generated"], time.monotonic() + 120
            while c.stats()["tokens_generated"] < start + REQUESTS * NEW // 8:
                if time.monotonic() > deadline:
                    done.append("the requests never got going")
                    return
                time.sleep(0.05)
        ray.kill(group.actors[0], no_restart=True)
        done.append("killed")

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    results = run_load(fleet.address, tag="k")
    killer.join()
    assert done == ["killed"], done
    assert_all_exact(results, make_checkpoint("llama"))
    wait_until(lambda: group.restart_count == 1, 60, "replica 0's supervision restarted its group")
    with fleet.client() as c:
        wait_until(lambda: all(r["healthy"] for r in c.health()["replicas"]), 60, "replica 0 taken back")
        stats = c.stats()
    assert stats["router"]["failovers"] >= 1 and stats["replicas"][0]["lost"] >= 1, stats["router"]
    assert stats["replicas"][0]["restart_count"] == 1 and stats["restart_count"] == 1
    # the restarted replica serves again: a burst reaches both replicas
    routed = [r["routed"] for r in stats["replicas"]]
    assert_all_exact(run_load(fleet.address, n=16, tag="b"), make_checkpoint("llama"), n=16)
    with fleet.client() as c:
        assert all(r["routed"] > k for r, k in zip(c.stats()["replicas"], routed))


@pytest.mark.slow
def test_weight_update_across_replicas_under_load(fleet, make_checkpoint):
    new, bad = make_checkpoint("llama", seed=1), make_checkpoint("llama", seed=2, intermediate_size=96)
    with fleet.client() as c:
        versions = c.stats()["weights"]["versions"]
    got: dict[str, dict] = {}
    loader = threading.Thread(target=lambda: got.update(run_load(fleet.address, n=48, tag="u")))
    loader.start()
    time.sleep(1.0)
    with fleet.client() as c:
        result = c.update_weights(str(new))
    loader.join()
    assert result["ok"] and result["versions"] == [v + 1 for v in versions], result
    assert len(got) == 48 and all(r["status"] == RequestStatus.FINISHED and len(r["tokens"]) == NEW
                                  for r in got.values()), [r for r in got.values() if "error" in r][:2]
    after = [v + 1 for v in versions]
    with fleet.client() as c:
        assert c.stats()["weights"]["versions"] == after
        with pytest.raises(WeightUpdateError) as refused:
            c.update_weights(str(bad))
        assert refused.value.result["replica"] == 0 and "replica 0" in refused.value.reason
        assert c.stats()["weights"]["versions"] == after  # nothing changed anywhere
        assert [r["weights"]["path"] for r in c.health()["replicas"]] == [str(new)] * 2
    assert_all_exact(run_load(fleet.address, n=16, tag="n"), new, n=16)  # every replica serves the new weights


@pytest.mark.slow
def test_spread_needs_as_many_nodes_as_replicas(fleet, make_checkpoint):
    with pytest.raises(ValueError, match="spread: 2 replicas need 2 nodes"):
        start_replicas(make_checkpoint("llama"), tp=1, replicas=2, config=PRESET, spread=True)


def submit_job(jobs, entry: str, timeout: float = 90.0) -> str:
    """Submit, retrying while the head answers 500 (its dashboard agent, which runs jobs, has not registered
    yet: Ray says "No available agent to submit job, please try again later")."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return jobs.submit_job(entrypoint=entry, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


@pytest.mark.slow
def test_a_ray_job_takes_the_service_handle_and_gets_correct_outputs(ray_module, fleet, make_checkpoint):
    """A script submitted with Ray's JobSubmissionClient finds the ServiceHandle actor by name and generates."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    jobs = JobSubmissionClient(ray_module)
    ps = prompts()[:4]
    entry = " ".join(shlex.quote(a) for a in (sys.executable, str(REPO / "tests" / "scripts" / "replicas_job.py"),
                                              SERVICE, json.dumps(ps), str(NEW)))
    job = submit_job(jobs, entry)
    wait_until(lambda: jobs.get_job_status(job) in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED),
               120, "the job ended")
    logs = jobs.get_job_logs(job)
    assert jobs.get_job_status(job) == JobStatus.SUCCEEDED, logs[-3000:]
    line = next(x for x in logs.splitlines() if x.startswith("JOB-RESULT "))
    with fleet.client() as c:  # the weights it serves now (an earlier test may have updated them)
        served = c.health()["weights"]["path"] or make_checkpoint("llama")
    assert json.loads(line[len("JOB-RESULT "):]) == hf_greedy(served, prompts(), NEW)[:4]


@pytest.mark.slow
def test_one_tp2_replica_next_to_one_tp1(fleet, make_checkpoint):
    """Last: the 2 x TP=1 fleet makes room for a TP=2 replica and a TP=1 one behind one router; MIXED_REQUESTS
    requests (the main test's checks on a smaller load) all exact, and both replicas take some."""
    fleet.shutdown()
    mixed = start_replicas(make_checkpoint("llama"), tp=[2, 1], config=PRESET, address="tcp://127.0.0.1:*",
                           ready_timeout=300)
    try:
        results = run_load(mixed.address, n=MIXED_REQUESTS, tag="m")
        with mixed.client() as c:
            health, stats = c.health(), c.stats()
    finally:
        mixed.shutdown()
    assert_all_exact(results, make_checkpoint("llama"), n=MIXED_REQUESTS)
    assert [r["world_size"] for r in health["replicas"]] == [2, 1] and health["world_size"] == 3
    assert all(r["routed"] > 0 for r in stats["replicas"]), stats["replicas"]


def test_replicas_need_the_ray_launcher():
    from launch.cli import main

    with pytest.raises(SystemExit, match="--replicas and --spread need --launcher ray"):
        main(["serve", "--model", "unused", "--replicas", "2"])
