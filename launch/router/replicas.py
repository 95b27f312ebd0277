"""Data-parallel replicas on Ray behind one address: R Lockstep groups and the router in front of them.

Each replica is a whole group as `lockstep serve --launcher ray` starts it (launch/ray_launcher.py), with its own
placement group, front door, weights record and supervision thread (docs/replicas.md). `spread=True` pins each
group to a different node through a sliver of its `node:<ip>` resource; the replicas then bind every interface so
that the router (launch/router/router.py, in this process) can reach them."""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.client import Client
from cluster.config import ContinuousBatchingConfig, read_preset
from launch.router.router import Router, RouterConfig
from launch.serve import weights_record_path
from launch.ray_launcher import RayCluster, serve_until_stopped, start_ray_cluster

NODE_SLIVER = 0.001  # of a node's `node:<ip>` resource, per bundle: pins a group to that node
SERVICE_NAMESPACE = "lockstep"  # where the ServiceHandle actor is named


class ServiceHandle:
    """A named, detached Ray actor (`ray.get_actor(name, namespace=...)`) handing Ray jobs a client of the router."""

    def __init__(self, address: str):
        self._address = address

    def address(self) -> str:
        return self._address

    def client(self, **kwargs: Any) -> Client:
        return Client(self._address, **kwargs)


@dataclass
class Replicas:
    """Running replicas and their router. `client()` talks to the router; `shutdown()` ends everything."""

    groups: list[RayCluster]
    router: Router
    owns_ray: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    supervisors: list[threading.Thread] = field(default_factory=list)
    service: Any = None  # the ServiceHandle actor, when published
    closed: bool = False

    @property
    def address(self) -> str:
        return self.router.address

    def client(self, **kwargs: Any) -> Client:
        return Client(self.address, **kwargs)

    def shutdown(self, timeout: float = 30.0) -> list[list[int | None]]:
        """Stop the router, the supervision and every group; each group's rank exit codes."""
        import ray

        if self.closed:
            return []
        self.closed = True
        if self.service is not None:
            ray.kill(self.service, no_restart=True)
        self.stop.set()
        self.router.close()
        for t in self.supervisors:
            t.join(timeout)
        codes = [g.shutdown(timeout) for g in self.groups]
        if self.owns_ray:
            ray.shutdown()
        return codes


def spread_nodes(replicas: int, cpus: int, gpus: int) -> list[str]:
    """IPs of `replicas` different alive nodes with `cpus` CPUs (and `gpus` GPUs) free, the freest first."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    fits = [n for n in nodes if n["Resources"].get("CPU", 0) >= cpus and n["Resources"].get("GPU", 0) >= gpus]
    fits.sort(key=lambda n: -n["Resources"].get("CPU", 0))
    ips = list(dict.fromkeys(n["NodeManagerAddress"] for n in fits))
    if len(ips) < replicas:
        raise ValueError(f"spread: {replicas} replicas need {replicas} nodes with {cpus} CPU(s) and {gpus} GPU(s) "
                         f"each; Ray has {len(ips)} such node(s) ({', '.join(ips) or 'none'})")
    return ips[:replicas]


def start_replicas(model_dir: str | os.PathLike, tp: int | list[int] = 1, replicas: int = 2,
                   config: dict | str | os.PathLike | None = None, address: str | None = None,
                   spread: bool = False, gpu: bool = False, max_restarts: int = 3, ready_timeout: float = 300.0,
                   ray_init: dict | None = None, run_dir: str | None = None, policy: str | None = None,
                   service_name: str | None = None) -> Replicas:
    """Start `replicas` groups of `tp` ranks (or one per entry of a list of TP sizes) and the router at `address`;
    returns once every replica is healthy. The preset's `[router]` table sets RouterConfig fields; `service_name`:
    publish a ServiceHandle actor of that name (namespace `lockstep`) for Ray jobs."""
    import ray

    tps = list(tp) if isinstance(tp, list) else [tp] * replicas
    if not tps or min(tps) < 1:
        raise ValueError(f"need at least one replica of tp >= 1, got {tps}")
    model_dir = str(Path(model_dir).resolve())
    preset = read_preset(config)
    router_config = RouterConfig(**preset.get("router", {}))
    # the replicas' page size as their managers resolve it: affinity hashes the pages their block managers do
    router_config.page_size = ContinuousBatchingConfig.from_any(preset.get("continuous_batching")).page_size
    router_config.address = address or router_config.address
    router_config.policy = policy or router_config.policy
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(**(ray_init or {}))
    run_dir = run_dir or tempfile.mkdtemp(prefix="lockstep-replicas-")
    groups: list[RayCluster] = []
    try:
        nodes = spread_nodes(len(tps), max(tps), max(tps) if gpu else 0) if spread else [None] * len(tps)
        bind = "tcp://0.0.0.0:*" if spread else "tcp://127.0.0.1:*"
        for i, (n, node) in enumerate(zip(tps, nodes)):
            state = weights_record_path(os.path.join(run_dir, f"replica-{i}"))
            groups.append(start_ray_cluster(model_dir, tp=n, config=preset, address=bind, gpu=gpu,
                                            ready_timeout=ready_timeout, state_file=state,
                                            bundle_extra={f"node:{node}": NODE_SLIVER} if node else None,
                                            name=f"lockstep-{os.getpid()}-replica-{i}"))
        router = Router([g.address for g in groups], router_config, [model_dir] * len(groups)).start(ready_timeout)
    except BaseException:
        for g in groups:
            g.shutdown(timeout=10)
        if owns_ray:
            ray.shutdown()
        raise
    fleet = Replicas(groups, router, owns_ray)
    fleet.supervisors = [threading.Thread(target=g.supervise, args=(fleet.stop, max_restarts), name=f"supervise-{i}",
                                          daemon=True) for i, g in enumerate(groups)]  # restart after a rank failed
    for t in fleet.supervisors:
        t.start()
    if service_name:  # no CPU: the actor only answers with the address
        fleet.service = ray.remote(ServiceHandle).options(name=service_name, namespace=SERVICE_NAMESPACE,
                                                          lifetime="detached", num_cpus=0,
                                                          max_restarts=-1).remote(router.address)
        ray.get(fleet.service.client.remote(), timeout=ready_timeout)  # named and answering before a job looks
    return fleet


def run_cli(args: Any) -> int:
    """`lockstep serve --replicas R --launcher ray [--spread]`: serve until SIGINT or SIGTERM."""
    fleet = start_replicas(args.model, tp=args.tp, replicas=args.replicas, config=args.config, address=args.address,
                           spread=args.spread, gpu=args.gpu, max_restarts=args.max_restarts, run_dir=args.run_dir,
                           service_name=args.service_name)
    serve_until_stopped(fleet.address, args, lambda stop: stop.wait(), fleet.shutdown)
    return 0
