"""Ray, both ways, on a real local Ray (2 CPUs): `cluster.Client` handles passed into Ray tasks and an actor
submit to a torchrun cluster; and the ranks themselves run as Ray actors (`start_ray_cluster`, and
`lockstep serve --launcher ray`). Outputs must be token-identical to transformers' greedy generate.

The submitting tasks and actor ask for num_cpus=0: they only wait on the network, and the two CPUs are
the rank actors' bundles in the second half.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from cluster.client.client import Client  # noqa: E402
from launch.ray_launcher import start_ray_cluster  # noqa: E402
from launch.torchrun import free_port  # noqa: E402
from tests.conftest import REPO, hf_greedy  # noqa: E402
from tests.serving import serve  # noqa: E402
from tests.workloads import mixed_prompts  # noqa: E402

NEW = 16
PRESET = {"continuous_batching": {"page_size": 16, "max_batch_tokens": 256, "cpu_group_timeout": 5.0},
          "serve": {"client_timeout_s": 5.0}}


def prompts() -> list[list[int]]:
    return mixed_prompts(2048)[:8]


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}})
    try:
        yield
    finally:
        ray.shutdown()


@ray.remote(num_cpus=0)
def generate_in_task(client: Client, prompt: list[int], n: int) -> tuple[list[int], bool]:
    """A Ray task that got a handle: it connects in this worker process on first use."""
    import sys

    return client.generate(prompt, max_new_tokens=n).generated_tokens, "torch" in sys.modules


@ray.remote(num_cpus=0)
class Submitter:
    """A Ray actor that keeps one handle (one connection) for all its calls."""

    def __init__(self, client: Client):
        self.client = client

    def run(self, batch: list[list[int]], n: int) -> list[list[int]]:
        rids = [self.client.submit(p, max_new_tokens=n) for p in batch]
        return [self.client.result(r, timeout=120).generated_tokens for r in rids]


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s: {what}")


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie has ended
    except OSError:
        return True


def cpus_free() -> bool:
    return ray.available_resources().get("CPU", 0) == 2


@pytest.mark.slow
def test_client_handle_in_ray_tasks_and_actor(ray_session, make_checkpoint, tmp_path):
    model = make_checkpoint("llama")
    want = hf_greedy(model, prompts(), NEW)
    with serve(model, tp=2, tmp_path=tmp_path) as server:
        handle = Client(server.address, timeout=120)
        refs = [generate_in_task.remote(handle, p, NEW) for p in prompts()]
        got = ray.get(refs, timeout=180)
        assert [tokens for tokens, _ in got] == want
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
        dropped = Client(server.address, timeout=60)
        dropped.health()  # connects
        assert io_threads() == before + 1
        del dropped
        gc.collect()
        wait_until(lambda: io_threads() == before, 10, "a dropped client's I/O thread ended")


@pytest.mark.slow
def test_ranks_as_ray_actors(ray_session, make_checkpoint):
    model = make_checkpoint("llama")
    want = hf_greedy(model, prompts(), NEW)
    handle = start_ray_cluster(model, tp=2, config=PRESET, address=f"tcp://127.0.0.1:{free_port()}",
                               ready_timeout=300)
    try:
        assert len(handle.actors) == 2 and not any(map(process_gone, handle.pids))
        with handle.client(timeout=120) as c:
            rids = [c.submit(p, max_new_tokens=NEW) for p in prompts()]
            assert [c.result(r).generated_tokens for r in rids] == want
        tokens, _ = ray.get(generate_in_task.remote(handle.client(), prompts()[0], NEW), timeout=120)
        assert tokens == want[0]
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
    wait_until(cpus_free, 30, "both CPUs back in Ray")


@pytest.mark.slow
def test_rank_failure_before_ready_is_reported(ray_session, tmp_path):
    """A rank that cannot load raises in start_ray_cluster with its traceback, and nothing stays behind."""
    with pytest.raises(RuntimeError, match="no config.json"):
        start_ray_cluster(tmp_path / "missing", tp=2, ready_timeout=300)
    wait_until(cpus_free, 30, "both CPUs back in Ray after the failed launch")


@pytest.mark.slow
def test_cli_launcher_ray(ray_session, make_checkpoint, tmp_path, monkeypatch):
    """`lockstep serve --launcher ray` joins the running Ray (RAY_ADDRESS), serves, and on SIGINT exits 0
    and gives the actors' CPUs back."""
    model = make_checkpoint("llama")
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    wait_until(cpus_free, 30, "both CPUs free before the launch")
    with serve(model, tp=2, extra=["--launcher", "ray"], tmp_path=tmp_path) as server:
        with Client(server.address, timeout=120) as c:
            assert c.generate(prompts()[1], max_new_tokens=NEW).generated_tokens == hf_greedy(
                model, prompts(), NEW)[1]
        os.killpg(server.proc.pid, signal.SIGINT)
        assert server.wait(60) == 0, server.log[-4000:]
    wait_until(cpus_free, 30, "both CPUs back in Ray after the CLI exited")
