"""Ray, both ways, on a real local Ray (the one the Ray modules share, tests/ray_session.py): the ranks run as Ray
actors (`start_ray_cluster`, and `lockstep serve --launcher ray`); and `cluster.Client` handles passed into Ray
tasks and an actor submit to such a cluster (the first one's group, `ray_group`: a client does not care how the
ranks were started, so they need no torchrun server of their own). Outputs must be token-identical to
transformers' greedy generate.

The submitting tasks and actor ask for num_cpus=0: they only wait on the network; the CPUs are the rank actors'
bundles.
"""

from __future__ import annotations

import os
import signal

import pytest

ray = pytest.importorskip("ray")

from cluster.client.client import Client  # noqa: E402
from launch.ray_launcher import start_ray_cluster  # noqa: E402
from launch.torchrun import free_port  # noqa: E402
from tests.conftest import hf_greedy  # noqa: E402
from tests.ray_session import cpus_free, wait_until  # noqa: E402
from tests.serving import serve  # noqa: E402
from tests.workloads import mixed_prompts  # noqa: E402

NEW = 16
# a rank actor on a busy machine (the suite's other workers) can go seconds without the CPU, and a peer that sees
# its liveness stamp stand still for most of cpu_group_timeout kills it as hung (cluster/liveness.py; a fresh-clone
# run lost rank 0 so at 5 s, when Ray still ran its workers at niceness 15: tests/ray_session.py). These tests do not
# test a hang: a window that a starved but healthy rank keeps.
PRESET = {"continuous_batching": {"page_size": 16, "max_batch_tokens": 256, "cpu_group_timeout": 15.0},
          "serve": {"client_timeout_s": 5.0}}


def prompts() -> list[list[int]]:
    return mixed_prompts(2048)[:8]


@pytest.fixture(scope="module")
def ray_group(ray_module, make_checkpoint):
    """A TP=2 group of rank actors (`start_ray_cluster`) on the llama checkpoint; test_ranks_as_ray_actors, which
    runs after the client handle test, shuts it down and checks what that leaves."""
    handle = start_ray_cluster(make_checkpoint("llama"), tp=2, config=PRESET,
                               address=f"tcp://127.0.0.1:{free_port()}", ready_timeout=300)
    try:
        yield handle
    finally:
        handle.shutdown()


@ray.remote(num_cpus=0)
def generate_in_task(client: Client, batch: list[list[int]], n: int) -> tuple[list[list[int]], bool]:
    """A Ray task that got a handle: it connects in this worker process on first use."""
    import sys

    return [client.generate(p, max_new_tokens=n).generated_tokens for p in batch], "torch" in sys.modules


@ray.remote(num_cpus=0)
class Submitter:
    """A Ray actor that keeps one handle (one connection) for all its calls."""

    def __init__(self, client: Client):
        self.client = client

    def run(self, batch: list[list[int]], n: int) -> list[list[int]]:
        rids = [self.client.submit(p, max_new_tokens=n) for p in batch]
        return [self.client.result(r, timeout=120).generated_tokens for r in rids]


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has ended
    except OSError:
        return True


@pytest.mark.slow
def test_client_handle_in_ray_tasks_and_actor(ray_group, make_checkpoint):
    want = hf_greedy(make_checkpoint("llama"), prompts(), NEW)
    handle = Client(ray_group.address, timeout=120)
    halves = [prompts()[:4], prompts()[4:]]  # two tasks at once, four prompts each
    got = ray.get([generate_in_task.remote(handle, half, NEW) for half in halves], timeout=180)
    assert [tokens for batch, _ in got for tokens in batch] == want
    assert not any(torch_loaded for _, torch_loaded in got), "a client task imported torch"
    assert handle._io is None  # the handle went to the tasks as its settings; this one never connected

    submitter = Submitter.remote(handle)
    try:
        assert ray.get(submitter.run.remote(prompts(), NEW), timeout=180) == want
    finally:
        ray.kill(submitter)

    # a Ray worker unpickles a fresh handle per task and outlives it: a dropped handle must close itself
    import gc
    import threading

    def io_threads() -> int:
        return sum(t.name == "lockstep-client" for t in threading.enumerate())

    before = io_threads()
    dropped = Client(ray_group.address, timeout=60)
    dropped.health()  # connects
    assert io_threads() == before + 1
    del dropped
    gc.collect()
    wait_until(lambda: io_threads() == before, 10, "a dropped client's I/O thread ended")


@pytest.mark.slow
def test_ranks_as_ray_actors(ray_group, make_checkpoint):
    """The group serves (from this process and from a Ray task), and `shutdown` ends it completely."""
    handle = ray_group
    want = hf_greedy(make_checkpoint("llama"), prompts(), NEW)
    try:
        assert len(handle.actors) == 2 and not any(map(process_gone, handle.pids))
        with handle.client(timeout=120) as c:
            rids = [c.submit(p, max_new_tokens=NEW) for p in prompts()]
            assert [c.result(r).generated_tokens for r in rids] == want
        batch, _ = ray.get(generate_in_task.remote(handle.client(), prompts()[:1], NEW), timeout=120)
        assert batch == want[:1]
        assert handle.poll() is None  # every rank still serving
    finally:
        codes = handle.shutdown()
    assert codes == [0, 0]
    for actor in handle.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.status.remote(), timeout=30)
    wait_until(lambda: all(map(process_gone, handle.pids)), 30, f"rank processes {handle.pids} ended")
    wait_until(lambda: ray.util.placement_group_table(handle.placement_group)["state"] == "REMOVED", 30,
               "placement group removed")
    wait_until(cpus_free, 30, "the CPUs back in Ray")


@pytest.mark.slow
def test_rank_failure_before_ready_is_reported(ray_module, tmp_path):
    """A rank that cannot load raises in start_ray_cluster with its traceback, and nothing stays behind."""
    with pytest.raises(RuntimeError, match="no config.json"):
        start_ray_cluster(tmp_path / "missing", tp=2, ready_timeout=300)
    wait_until(cpus_free, 30, "the CPUs back in Ray after the failed launch")


@pytest.mark.slow
def test_cli_launcher_ray(ray_module, make_checkpoint, monkeypatch):
    """`lockstep serve --launcher ray` joins the running Ray (RAY_ADDRESS), serves, and on SIGINT exits 0
    and gives the actors' CPUs back."""
    model = make_checkpoint("llama")
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    wait_until(cpus_free, 30, "the CPUs free before the launch")
    with serve(model, tp=2, extra=["--launcher", "ray"]) as server:
        with Client(server.address, timeout=120) as c:
            assert c.generate(prompts()[1], max_new_tokens=NEW).generated_tokens == hf_greedy(
                model, prompts(), NEW)[1]
        os.killpg(server.proc.pid, signal.SIGINT)
        assert server.wait(60) == 0, server.log[-4000:]
    wait_until(cpus_free, 30, "the CPUs back in Ray after the CLI exited")
