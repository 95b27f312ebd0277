"""The router's view of its replicas: one upstream client each, their health, and where a request goes.

Each replica is a whole group; the router reaches it through a `cluster.Client` whose `on_lost` hands lost
requests to the failover (launch/router/failover.py). A second client probes `health`: a replica is taken in on
ok (a new epoch: its prefix cache is empty again) and out once it loses a request or stops answering.

Routing (`choose`): the healthy replica with the least outstanding requests, unless one holds a longer prefix of
the prompt (launch/router/prefix_affinity.py) with at most `affinity_slack` more outstanding. `policy="round_robin"`
or `"least"` turn affinity off (benchmarks). Torch-free."""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster.client import Client
from cluster.errors import ClientError
from cluster.client.pending import PendingRequest
from launch.router.prefix_affinity import PrefixAffinity

log = logging.getLogger("lockstep")

POLICIES = ("affinity", "least", "round_robin")


@dataclass
class Replica:
    index: int
    address: str
    client: Client  # its lost requests go to the router's failover
    probe: Client  # health checks, apart from the requests' connection
    healthy: bool = False
    epoch: int = 0  # bumped each time it is taken back in (a restart or new weights empty its prefix cache)
    outstanding: int = 0  # routed here and not finished
    routed: int = 0
    prefix_routed: int = 0  # routed here because it held the prompt's prefix
    lost: int = 0  # requests it lost (failed over elsewhere)
    health: dict[str, Any] = field(default_factory=dict)  # its last health answer

    def report(self) -> dict[str, Any]:
        """This replica's line in the router's stats and health."""
        weights = self.health.get("weights") or {}
        return {"index": self.index, "address": self.address, "healthy": self.healthy, "epoch": self.epoch,
                "outstanding": self.outstanding, "routed": self.routed, "prefix_routed": self.prefix_routed,
                "lost": self.lost, "restart_count": self.health.get("restart_count", 0),
                "world_size": self.health.get("world_size", 0), "weight_version": weights.get("version"),
                "weights": weights}


class ReplicaPool:
    def __init__(self, addresses: list[str], page_size: int,
                 on_lost: Callable[[int, PendingRequest, ClientError], None], policy: str = "affinity",
                 affinity_slack: int = 8, health_every_s: float = 0.5, server_timeout_s: float = 3.0):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy, self.affinity_slack, self.health_every_s = policy, affinity_slack, health_every_s
        self.replicas = [Replica(i, a, Client(a, server_timeout_s=server_timeout_s, resume=True, timeout=None,
                                              on_lost=functools.partial(on_lost, i)),
                                 Client(a, resume=False, server_timeout_s=server_timeout_s))
                         for i, a in enumerate(addresses)]
        self.affinity = PrefixAffinity(page_size)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified when a replica is taken in
        self.turn = itertools.count()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="lockstep-router-health", daemon=True)

    def start(self) -> "ReplicaPool":
        self.thread.start()
        return self

    # ------------------------------------------------------------------ routing
    def choose(self, prompt: list[int] | None) -> Replica:
        """The replica for a new request (counted as outstanding there); the prompt's pages are learned."""
        hashes = self.affinity.hashes(prompt) if prompt and self.policy == "affinity" else []
        with self.lock:
            pool = [r for r in self.replicas if r.healthy] or self.replicas  # none healthy: it waits in failover
            chosen = pool[next(self.turn) % len(pool)] if self.policy == "round_robin" else self._least(pool)
            by_prefix = False
            depth = self.affinity.holders(hashes, {r.index: r.epoch for r in pool}) if hashes else {}
            if depth:
                holder = self.replicas[max(depth, key=lambda i: (depth[i], -self.replicas[i].outstanding))]
                if holder.outstanding <= chosen.outstanding + self.affinity_slack:
                    chosen, by_prefix = holder, True
            chosen.outstanding += 1
            chosen.routed += 1
            chosen.prefix_routed += by_prefix
            if hashes:
                self.affinity.learn(hashes, chosen.index, chosen.epoch)
            return chosen

    def _least(self, pool: list[Replica]) -> Replica:
        low = min(r.outstanding for r in pool)
        ties = [r for r in pool if r.outstanding == low]
        return ties[next(self.turn) % len(ties)]

    def for_resume(self, origin: int) -> Replica | None:
        """A healthy replica (not `origin` if any other is) to resume a request on, counted there; None if none."""
        with self.lock:
            pool = [r for r in self.replicas if r.healthy]
            others = [r for r in pool if r.index != origin]
            if not pool:
                return None
            chosen = self._least(others or pool)
            chosen.outstanding += 1
            return chosen

    def finished(self, index: int) -> None:
        with self.lock:
            self.replicas[index].outstanding -= 1

    def lost(self, index: int) -> None:
        """`index` lost a request (still counted there until it moves): it is out until its health says ok."""
        with self.lock:
            self.replicas[index].lost += 1
            self.replicas[index].healthy = False

    def wait_healthy(self, timeout: float) -> bool:
        """True once some replica is healthy (at once if one is), False after `timeout`."""
        with self.changed:
            return self.changed.wait_for(lambda: any(r.healthy for r in self.replicas), timeout)

    def reports(self) -> list[dict[str, Any]]:
        with self.lock:
            return [r.report() for r in self.replicas]

    def new_epoch(self) -> None:
        """Every replica's prefix cache was emptied (new weights): forget what they held."""
        with self.lock:
            for r in self.replicas:
                r.epoch += 1

    # ------------------------------------------------------------------ health
    def _watch(self) -> None:
        while not self.stop_event.wait(self.health_every_s):
            for r in self.replicas:
                self.probe(r)

    def probe(self, r: Replica) -> bool:
        """Ask `r` for its health once; take it in (a new epoch) or out. Returns whether it is healthy."""
        try:
            data = r.probe.health(timeout=max(1.0, 2 * self.health_every_s))
            ok = isinstance(data, dict) and data.get("ok") is True
        except (FutureTimeout, ClientError, TimeoutError):
            data, ok = None, False
        with self.changed:
            if data is not None:
                r.health = data
            if ok and not r.healthy:
                r.epoch += 1
                log.info("router: replica %d (%s) is healthy", r.index, r.address)
                self.changed.notify_all()
            elif not ok and r.healthy:
                log.warning("router: replica %d (%s) is not healthy", r.index, r.address)
            r.healthy = ok
        return ok

    def close(self) -> None:
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(5)
        for r in self.replicas:
            r.client.close()
            r.probe.close()
