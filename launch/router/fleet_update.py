"""One weight update for every replica: all end on the new checkpoint, or all stay on what they served.

Each replica's own update is all-or-none across its ranks (docs/recovery.md); this extends that across replicas.
Every replica must be healthy and its current weights loadable again (where a refused update rolls back to); then
all are paused, updated one after the other, and resumed. If one refuses, those already updated load their previous
weights again (new version numbers), and the result says `ok` false with the refusing replica. Torch-free."""

from __future__ import annotations

import time
from contextlib import suppress
from typing import Any, Protocol

from cluster.errors import ClientError, WeightUpdateError


class ReplicaAdmin(Protocol):
    """What the fleet update needs of a replica's client (cluster.client.client.Client has it)."""

    def health(self, timeout: float | None = ...) -> dict: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def update_weights(self, path: str, kv_policy: str = ...) -> dict: ...


def update_all(clients: list[ReplicaAdmin], path: str, kv_policy: str = "keep",
               fallbacks: list[str | None] | None = None) -> dict[str, Any]:
    """Update every replica from `path`, all or none (`fallbacks[i]`: replica i's model directory, its initial
    weights): {ok, versions, seconds} or {ok: false, error, replica, ...}."""
    start = time.monotonic()
    fallbacks = fallbacks or [None] * len(clients)
    previous: list[str] = []
    for i, c in enumerate(clients):
        try:
            health = c.health(10.0)
        except (ClientError, TimeoutError) as e:
            return refused(i, f"replica {i} did not answer health: {e}")
        if health.get("ok") is not True:
            return refused(i, f"replica {i} is not healthy: {health.get('failure')}")
        weights = health.get("weights") or {}  # the checkpoint that loads them again; pushed ones cannot be
        back = {"checkpoint": weights.get("path"), "initial": fallbacks[i]}.get(weights.get("source"))
        if back is None:
            return refused(i, f"replica {i} serves weights that cannot be loaded again "
                              f"({weights.get('source')}): an update could not be rolled back")
        previous.append(back)
    paused: list[ReplicaAdmin] = []
    try:
        for c in clients:
            c.pause()
            paused.append(c)
        versions: list[int] = []
        for i, c in enumerate(clients):
            try:
                versions.append(int(c.update_weights(path, kv_policy)["version"]))
            except ClientError as e:
                result = refused(i, f"replica {i}: {e.reason if isinstance(e, WeightUpdateError) else e}")
                result["rolled_back"], result["rollback_errors"] = rollback(clients[:i], previous, kv_policy)
                return result
        return {"ok": True, "versions": versions, "version": versions[0] if len(set(versions)) == 1 else None,
                "seconds": time.monotonic() - start}
    finally:
        for c in paused:
            with suppress(ClientError):  # its group restarted meanwhile: a new group is not paused
                c.resume()


def rollback(clients: list[ReplicaAdmin], previous: list[str], kv_policy: str) -> tuple[list[int], list[str]]:
    """Load each client's previous weights again: the new version of each, and the errors of those that refused."""
    versions, errors = [], []
    for i, c in enumerate(clients):
        try:
            versions.append(int(c.update_weights(previous[i], kv_policy)["version"]))
        except ClientError as e:
            errors.append(f"replica {i}: {e}")
    return versions, errors


def refused(replica: int, error: str) -> dict[str, Any]:
    return {"ok": False, "error": error, "replica": replica}
