"""Issue 11's chaos acceptance under the Ray launcher: TP=2 ranks as Ray actors in a placement group, the
requests of tests/test_recovery_chaos.py in flight from 4 client processes (half streaming, half seeded
sampling, mixed lengths), rank 1's actor and then rank 0's killed with `ray.kill`. The launcher's supervision
(`RayCluster.supervise`, what `lockstep serve --launcher ray` runs) recreates the group in the same placement
group, on the same address, and the clients resume: every request completes token-identical to the same
request in an uninterrupted run on the same cluster, and every stream delivers each token once, in order.
"""

from __future__ import annotations

import threading
import time
import tomllib

import pytest

ray = pytest.importorskip("ray")

from cluster.client.client import Client  # noqa: E402
from cluster.outputs import RequestStatus  # noqa: E402
from launch.ray_launcher import start_ray_cluster  # noqa: E402
from tests.ray_session import wait_until  # noqa: E402
from tests.serving import fast_config  # noqa: E402
from tests.test_recovery_chaos import (CLIENTS, PER_CLIENT, all_requests, assert_resumed_exactly,  # noqa: E402
                                      in_process_reference)

PRESET = tomllib.loads(fast_config(client_timeout_s=10.0))


@pytest.fixture(scope="module")
def supervised(ray_module, make_checkpoint):
    """On the Ray the Ray modules share (tests/ray_session.py): the ranks as actors, `supervise` (max 3 restarts) in
    a thread, and the uninterrupted reference run of every request (in this process: tests/test_recovery_chaos.py).
    Yields (handle, reference, restarts done)."""
    # a port of ZeroMQ's choosing: the restarted group must bind the one the first group got
    handle = start_ray_cluster(make_checkpoint("llama"), tp=2, config=PRESET, address="tcp://127.0.0.1:*",
                               ready_timeout=300)
    stop, restarted = threading.Event(), []
    watcher = threading.Thread(target=handle.supervise, args=(stop, 3), kwargs={"on_restart": restarted.append},
                               name="supervise", daemon=True)
    watcher.start()
    try:
        yield handle, in_process_reference(make_checkpoint("llama")), restarted
    finally:
        stop.set()
        watcher.join(120)
        handle.shutdown()


def kill_actor_mid_generation(handle, rank: int, more_tokens: int, done: list) -> None:
    """`ray.kill` rank `rank`'s actor once the server generated `more_tokens` tokens more than when called."""
    with Client(handle.address, resume=False) as c:
        start = c.stats()["tokens_generated"]
        deadline = time.monotonic() + 120
        while c.stats()["tokens_generated"] < start + more_tokens:
            if time.monotonic() > deadline:
                done.append("the requests never got going")
                return
            time.sleep(0.05)
    ray.kill(handle.actors[rank], no_restart=True)
    done.append(f"killed rank {rank}")


def kill_worker_then_driver(handle, restarted: list, more_tokens: int, done: list) -> None:
    """Kill rank 1's actor mid-generation, wait for the supervisor's restart, then kill rank 0's the same way."""
    kill_actor_mid_generation(handle, 1, more_tokens, done)
    try:
        wait_until(lambda: len(restarted) == 1, 60, "the supervisor restarted the group")
    except AssertionError as e:
        done.append(str(e))
        return
    kill_actor_mid_generation(handle, 0, more_tokens, done)


@pytest.mark.slow
def test_killed_rank_actors_cost_seconds_not_requests(supervised):
    """Rank 1's actor, then (once the group is back) rank 0's, killed mid-generation in one load: each time the
    supervisor recreates the group in the same placement group, on the same address, and every request finishes
    token for token as uninterrupted, resumed once for each kill it was in flight for."""
    handle, reference, restarted = supervised
    assert len(reference) == CLIENTS * PER_CLIENT and all(r["status"] == RequestStatus.FINISHED
                                                          for r in reference.values())
    total = sum(len(r["tokens"]) for r in reference.values())
    pg, address, pids = handle.placement_group, handle.address, list(handle.pids)
    done: list[str] = []
    killer = threading.Thread(target=kill_worker_then_driver, args=(handle, restarted, total // 6, done))
    killer.start()
    got = all_requests(handle.address)
    killer.join()
    assert done == ["killed rank 1", "killed rank 0"], done
    wait_until(lambda: len(restarted) == 2, 60, "the supervisor restarted the group again")

    failed = {rid: r["error"] for rid, r in got.items() if "error" in r}
    assert not failed, f"{len(failed)} requests failed, e.g. {sorted(failed.items())[:2]}"
    assert_resumed_exactly(got, reference, kills=2)

    # the same placement group and address, new actor processes, and the group says it was restarted twice
    assert handle.placement_group is pg and ray.util.placement_group_table(pg)["state"] == "CREATED"
    assert handle.address == address and not set(handle.pids) & set(pids), (handle.pids, pids)
    assert handle.poll() is None
    with Client(handle.address) as c:
        health = c.health()
    assert health["ok"] and health["restart_count"] == handle.restart_count == 2, health
