"""The fleet's weight update (launch/router/fleet_update.py) on stand-in replicas: all end on the new checkpoint, or a
refusal rolls back the replicas already updated, and an update that could not be rolled back never starts."""

from __future__ import annotations

from cluster.errors import WeightUpdateError
from launch.router.fleet_update import update_all


class Replica:
    """A stand-in replica client: serves `path` under `version`; refuses checkpoints named in `refuses`."""

    def __init__(self, path: str | None = None, source: str = "initial", refuses: tuple[str, ...] = ()):
        self.path, self.source, self.version, self.refuses = path, source, 0, refuses
        self.paused, self.calls = False, []

    def health(self, timeout: float | None = None) -> dict:
        return {"ok": True, "weights": {"version": self.version, "source": self.source, "path": self.path}}

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def update_weights(self, path: str, kv_policy: str = "keep") -> dict:
        assert self.paused, "updated while not paused"
        self.calls.append(path)
        if path in self.refuses:
            raise WeightUpdateError(f"rank 0: no checkpoint at {path}", 0, {"ok": False})
        self.path, self.source, self.version = path, "checkpoint", self.version + 1
        return {"ok": True, "version": self.version}


def test_every_replica_takes_the_update():
    fleet = [Replica(), Replica()]
    result = update_all(fleet, "/new", fallbacks=["/model", "/model"])
    assert result["ok"] and result["versions"] == [1, 1] and result["version"] == 1
    assert [r.path for r in fleet] == ["/new", "/new"] and not any(r.paused for r in fleet)


def test_a_refusal_rolls_the_updated_replicas_back():
    fleet = [Replica("/old", "checkpoint"), Replica(), Replica(refuses=("/new",))]
    result = update_all(fleet, "/new", fallbacks=["/model"] * 3)
    assert not result["ok"] and result["replica"] == 2 and "replica 2: rank 0: no checkpoint" in result["error"]
    assert [r.calls for r in fleet] == [["/new", "/old"], ["/new", "/model"], ["/new"]]
    assert [r.path for r in fleet] == ["/old", "/model", None] and result["rollback_errors"] == []
    assert not any(r.paused for r in fleet)


def test_pushed_weights_are_not_updated_over():
    fleet = [Replica(), Replica(source="push")]
    result = update_all(fleet, "/new", fallbacks=["/model"] * 2)
    assert not result["ok"] and result["replica"] == 1 and "cannot be loaded again" in result["error"]
    assert [r.calls for r in fleet] == [[], []]

