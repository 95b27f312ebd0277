"""Start the ranks of `lockstep serve` as Ray actors instead of torchrun.

A PACK placement group reserves one bundle per rank (so the gloo/NCCL traffic stays local where it can); each
actor sets torchrun's environment (MASTER_ADDR: rank 0's node IP) and runs `launch.serve.serve_rank` in a thread:
a Ray actor must not install signal handlers or `os._exit`, so stopping is an event and ending it is `ray.kill`.
A failed group restarts in the same bundles (`--max-restarts`, docs/recovery.md). Only these few strings and
integers cross through Ray; the ranks talk over their own process groups, and clients over ZeroMQ (README)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cluster.client import Client
from launch.gateway.server import start_beside
from cluster.config import read_preset
from launch.serve import RANK_FAILED_EXIT, dialable
from launch.torchrun import free_port

REPO_ROOT = str(Path(__file__).resolve().parents[1])  # where `cluster`, `driver`, `worker`, `launch` live


class RankActor:
    """One rank in one Ray actor process, serving in a thread from `start` until `stop`. Methods stay short so the
    launcher can always reach the actor, even while its rank is loading or stuck in a broken collective."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.address: str | None = None  # rank 0, once it serves
        self.code: int | None = None  # serve_rank's exit code, once it returned
        self.error: str | None = None  # the traceback, when serve_rank raised

    def where(self) -> dict:
        """This actor's node (id and IP) and pid: the launcher derives LOCAL_RANK and MASTER_ADDR from it."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid()}

    def free_port(self) -> int:
        """A port free on this node right now (asked of rank 0's actor: the port must be free on its node)."""
        return free_port("")

    def start(self, env: dict[str, str], model_dir: str, preset: dict, address: str | None,
              state_file: str | None = None) -> None:
        """Set torchrun's environment and serve in a thread. Every rank's actor must be started (collectives)."""
        os.environ.update(env)
        fmt = f"%(asctime)s %(name)s rank{self.rank} %(levelname)s %(message)s"
        logging.basicConfig(level=logging.INFO, format=fmt)
        self.thread = threading.Thread(target=self._serve, args=(model_dir, preset, address, state_file),
                                       name=f"lockstep-rank{self.rank}", daemon=True)
        self.thread.start()

    def _serve(self, model_dir: str, preset: dict, address: str | None, state_file: str | None) -> None:
        from launch.serve import serve_rank

        try:
            self.code = serve_rank(model_dir, preset, address, self.stop_event,
                                   on_ready=lambda addr: setattr(self, "address", addr), state_file=state_file)
        except BaseException:
            self.error, self.code = traceback.format_exc(), 1

    def status(self) -> dict:
        """A snapshot: address (rank 0, once ready), code (None while serving), error (a traceback)."""
        return {"rank": self.rank, "address": self.address, "code": self.code, "error": self.error}

    def stop(self, timeout: float = 20.0) -> int | None:
        """Stop the rank; its exit code, or None if it did not return within `timeout`. Call it on every rank, as
        torchrun signals every rank: the driver stops the loop for all of them."""
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout)
        return self.code


@dataclass
class RayCluster:
    """A running cluster whose ranks are Ray actors. `client()` talks to it; `shutdown()` ends it."""

    address: str
    actors: list[Any]
    placement_group: Any
    pids: list[int] = field(default_factory=list)  # of the actor processes, rank order
    owns_ray: bool = False  # ray.init was called by start_ray_cluster: shutdown ends Ray too
    closed: bool = False
    start_args: dict = field(default_factory=dict)  # how the ranks were started (a restart starts them again so)
    restart_count: int = 0

    def client(self, **kwargs: Any) -> Client:
        """A blocking client of this cluster; it pickles as its settings, so it can go into Ray tasks."""
        return Client(self.address, **kwargs)

    def poll(self, timeout: float = 10.0) -> int | None:
        """None while every rank serves; else the first returned rank's exit code (RANK_FAILED_EXIT: an actor died)."""
        import ray

        try:
            states = ray.get([a.status.remote() for a in self.actors], timeout=timeout)
        except Exception:  # an actor died (RayActorError) or hangs (GetTimeoutError)
            return RANK_FAILED_EXIT
        codes = [s["code"] for s in states if s["code"] is not None]
        return codes[0] if codes else None

    def restart(self, timeout: float = 30.0) -> None:
        """New actors in the same bundles, address and weights record (torchrun's --max-restarts, under Ray); returns
        once rank 0 serves again (RuntimeError when it does not)."""
        old, self.actors = list(self.actors), []
        kill_actors(old, time.monotonic() + timeout)
        self.restart_count += 1
        start_ranks(self, **self.start_args)

    def supervise(self, stop: threading.Event, max_restarts: int, every: float = 1.0,
                  on_restart: Callable[[int], None] | None = None) -> int | None:
        """Watch the ranks until `stop` (None) or a rank ends for good (its exit code), restarting the group up to
        `max_restarts` times; `on_restart(n)` runs once the n-th restarted group serves."""
        while not stop.wait(every):
            code = self.poll()
            while code not in (None, 0) and self.restart_count < max_restarts:
                print(f"lockstep: a rank failed (exit code {code}); restart {self.restart_count + 1}", flush=True)
                try:
                    self.restart()
                except Exception as e:  # noqa: BLE001  (a restart that did not come up counts; try the next)
                    print(f"lockstep: restart {self.restart_count} failed: {e}", flush=True)
                    continue
                code = None
                if on_restart is not None:
                    on_restart(self.restart_count)
            if code is not None:
                return code
        return None

    def shutdown(self, timeout: float = 30.0) -> list[int | None]:
        """Stop every rank, kill the actors, free the placement group; each rank's exit code (None: not in time).
        Idempotent; returns once the actors are dead."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.closed:
            return []
        self.closed = True
        codes: list[int | None] = [None] * len(self.actors)
        for i, ref in enumerate([a.stop.remote(timeout) for a in self.actors]):
            with suppress(Exception):  # dead or stuck: ray.kill below ends it either way
                codes[i] = ray.get(ref, timeout=timeout + 10)
        kill_actors(self.actors, time.monotonic() + timeout)
        with suppress(Exception):
            remove_placement_group(self.placement_group)
        if self.owns_ray:
            ray.shutdown()
        return codes


def kill_actors(actors: list[Any], deadline: float) -> None:
    """`ray.kill` every actor; returns once Ray reports each dead, or at `deadline` (time.monotonic())."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    for a in actors:
        with suppress(Exception):
            ray.kill(a, no_restart=True)
    for a in actors:  # dead once a call on it raises RayActorError
        while time.monotonic() < deadline:
            try:
                ray.get(a.status.remote(), timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            except RayActorError:
                break
            except GetTimeoutError:
                continue
            time.sleep(0.1)


def start_ray_cluster(model_dir: str | os.PathLike, tp: int = 2, config: dict | str | os.PathLike | None = None,
                      address: str | None = None, gpu: bool = False, ready_timeout: float = 300.0,
                      ray_init: dict | None = None, state_file: str | None = None,
                      bundle_extra: dict[str, float] | None = None, name: str | None = None) -> RayCluster:
    """Start `tp` ranks of `lockstep serve` as Ray actors in a PACK placement group; returns once rank 0 serves at
    `.address` (a failure before tears everything down: RuntimeError names the rank). config: a preset (a TOML path
    is read here and shipped as a dict); `ray_init`: ray.init's arguments if Ray is not initialised; `state_file`:
    the weights record; `bundle_extra`: more resources a bundle asks for (replicas.py pins a group to a node so)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    model_dir = str(Path(model_dir).resolve())
    preset = read_preset(config)
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(**(ray_init or {}))
    bundle = ({"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}) | (bundle_extra or {})
    pg = placement_group([dict(bundle) for _ in range(tp)], strategy="PACK", name=name or f"lockstep-{os.getpid()}")
    actors: list[Any] = []
    handle = RayCluster(address="", actors=actors, placement_group=pg, owns_ray=owns_ray,
                        start_args={"model_dir": model_dir, "preset": preset, "address": address, "gpu": gpu,
                                    "ready_timeout": ready_timeout, "state_file": state_file})
    try:
        ray.get(pg.ready(), timeout=ready_timeout)
        start_ranks(handle, **handle.start_args)
        return handle
    except BaseException:
        if actors:
            handle.shutdown(timeout=10)
        else:
            remove_placement_group(pg)
            if owns_ray:
                ray.shutdown()
        raise


def start_ranks(handle: RayCluster, model_dir: str, preset: dict, address: str | None, gpu: bool,
                ready_timeout: float, state_file: str | None) -> None:
    """One actor per bundle of the handle's placement group; returns once rank 0 serves at `handle.address`."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg, actors, tp = handle.placement_group, handle.actors, len(handle.placement_group.bundle_specs)
    pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    remote = ray.remote(RankActor)
    for rank in range(tp):
        actors.append(remote.options(
            num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0, name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank),
            runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}).remote(rank, tp))
    places = ray.get([a.where.remote() for a in actors], timeout=ready_timeout)
    handle.pids = [p["pid"] for p in places]
    master_addr = places[0]["ip"]
    master_port = ray.get(actors[0].free_port.remote(), timeout=60)
    starts = []
    for rank, a in enumerate(actors):
        same_node = [r for r in range(tp) if places[r]["node_id"] == places[rank]["node_id"]]
        env = {"RANK": str(rank), "WORLD_SIZE": str(tp), "LOCAL_RANK": str(same_node.index(rank)),
               "LOCAL_WORLD_SIZE": str(len(same_node)), "MASTER_ADDR": master_addr,
               "MASTER_PORT": str(master_port), "TORCHELASTIC_RESTART_COUNT": str(handle.restart_count)}
        starts.append(a.start.remote(env, model_dir, preset, address, state_file))
    ray.get(starts, timeout=60)
    bound = wait_ready(actors, ready_timeout)
    handle.address = dialable(bound, master_addr)
    handle.start_args["address"] = bound  # a restart binds this endpoint (a `*` port resolved): same bundle, node


def wait_ready(actors: list[Any], timeout: float) -> str:
    """The address rank 0 bound, once it serves; RuntimeError as soon as any rank returned or died before."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = ray.get([a.status.remote() for a in actors], timeout=60)
        for s in states:
            if s["code"] is not None:
                raise RuntimeError(f"rank {s['rank']} exited with code {s['code']} before the cluster was ready"
                                   + (f":\n{s['error']}" if s["error"] else ""))
        if states[0]["address"]:
            return states[0]["address"]
        time.sleep(0.2)
    raise RuntimeError(f"rank 0 did not serve within {timeout:.0f}s")


def serve_until_stopped(address: str, args: Any, run: Callable[[threading.Event], Any],
                        shutdown: Callable[[], Any]) -> tuple[Any, Any]:
    """`lockstep serve --launcher ray`'s process (one group or replicas): print `ready <address>`, start the --http
    gateway, `run(stop)` until SIGINT or SIGTERM, then stop the gateway; returns what `run` and `shutdown` return."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # installed after ray.init, which sets its own SIGTERM handler
        signal.signal(sig, lambda *_: stop.set())
    print(f"ready {address}", flush=True)
    gateway = result = None
    try:
        gateway = start_beside(address, args)
        result = run(stop)
    finally:
        if gateway is not None:
            gateway.stop()
        ended = shutdown()
    return result, ended


def run_cli(args: Any) -> int:
    """`lockstep serve --launcher ray`: serve until a signal or a rank ends for good; torchrun's exit code."""
    if args.nnodes > 1:
        raise SystemExit("lockstep serve --launcher ray: --nnodes is torchrun's; Ray places the ranks on its own nodes")
    handle = start_ray_cluster(args.model, tp=args.tp, config=args.config, address=args.address, gpu=args.gpu,
                               state_file=args.state_file)
    code, codes = serve_until_stopped(handle.address, args, lambda stop: handle.supervise(stop, args.max_restarts),
                                      handle.shutdown)
    return code if code is not None else max((c for c in codes if c is not None), default=0)
