"""What the router answers itself: `health`, `stats` (all replicas together and each one) and the fleet's
weight update. docs/protocol.md ("The router") lists the fields. Torch-free."""

from __future__ import annotations

from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict
from typing import Any

from cluster import protocol as P
from cluster.errors import ClientError
from launch.router.fleet_update import update_all
from cluster.metrics_export import merge

STATS_WAIT_S = 5.0


def add_counters(total: dict[str, Any], more: dict[str, Any]) -> None:
    """Sum the numeric counters of `more` into `total` (nested maps too; flags and text are skipped)."""
    for k, v in more.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            total[k] = total.get(k, 0) + v
        elif isinstance(v, dict):
            add_counters(total.setdefault(k, {}), v)


class RouterStats:
    def __init__(self, router: Any, fallback_paths: list[str | None]):
        self.router, self.fallback_paths = router, fallback_paths

    def health(self) -> dict[str, Any]:
        """ok while some replica is healthy; the summed world size and restarts; each replica's line."""
        replicas = self.router.pool.reports()
        healthy = [r for r in replicas if r["healthy"]]
        return {"ok": bool(healthy), "world_size": sum(r["world_size"] for r in replicas),
                "restart_count": sum(r["restart_count"] for r in replicas),
                "failure": None if healthy else "no replica is healthy", "weights": (healthy or replicas)[0]["weights"],
                "router": True, "replicas": replicas}

    def stats(self) -> dict[str, Any]:
        """The replicas' own stats summed, the router's counters, and each replica's line with its stats."""
        router = self.router
        futures = [r.probe.data_future(P.STATS) for r in router.pool.replicas]
        replicas = router.pool.reports()
        total: dict[str, Any] = {}
        for line, fut in zip(replicas, futures):
            try:
                line["stats"] = fut.result(STATS_WAIT_S)
                add_counters(total, line["stats"])
            except (FutureTimeout, ClientError) as e:
                line["stats"], line["stats_error"] = None, str(e)
        counters = {k: v for k, v in asdict(router.counters).items() if k != "clients"}
        counters |= {"clients": len(router.counters.clients), "in_flight": len(router.routed),
                     "failovers": router.failover.moved, "policy": router.config.policy,
                     "prefix_routed": sum(r["prefix_routed"] for r in replicas),
                     "affinity_entries": len(router.pool.affinity)}
        total["metrics"] = merge([line["stats"].get("metrics", {}) for line in replicas if line["stats"]])
        return total | {"router": counters, "replicas": replicas,
                        "restart_count": sum(r["restart_count"] for r in replicas),
                        "weights": {"versions": [r["weight_version"] for r in replicas]}}

    def update_weights(self, path: str, kv_policy: str) -> dict[str, Any]:
        """Every replica to the checkpoint at `path`, all or none (launch/router/fleet_update.py)."""
        router = self.router
        result = update_all([r.client for r in router.pool.replicas], path, kv_policy, self.fallback_paths)
        router.counters.weight_updates += 1
        router.pool.new_epoch()  # an update (or its rollback) drops the replicas' cached prefixes
        for r in router.pool.replicas:
            router.pool.probe(r)  # the new versions show in stats at once
        return result
