"""Which weights a serving group serves, kept in a small state file so a restarted group serves them again
(docs/recovery.md): a checkpoint update is loaded again under its version; pushed (or tensor) weights cannot be, so
the group serves the newest weights it can restore under *their* version and reports the pushed version as lost."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

from cluster.dist import agree_messages
from cluster.errors import WeightUpdateError

log = logging.getLogger("lockstep")

MAX_RECORD_BYTES = 8192  # what rank 0 tells the others at a restore (paths included)


@dataclass
class ServedWeights:
    version: int = 0  # the weight version being served
    source: str = "initial"  # where they came from: initial (the model directory), checkpoint, push, tensors
    path: str | None = None  # the checkpoint directory (source checkpoint)
    restorable_version: int = 0  # the newest version a restart can load again (its checkpoint path, or initial)
    restorable_path: str | None = None  # that version's checkpoint directory (None: the initial weights)
    lost_version: int | None = None  # weights a restart could not restore (pushed), None when nothing was lost

    def after_update(self, source: str, path: str | None, version: int) -> "ServedWeights":
        """The record once an update from `source` (at `path`, for a checkpoint) applied as `version`."""
        if source == "checkpoint":
            return ServedWeights(version, source, path, version, path, self.lost_version)
        return ServedWeights(version, source, None, self.restorable_version, self.restorable_path, self.lost_version)

    def report(self) -> dict[str, Any]:
        """What health and stats say about the weights."""
        return {"version": self.version, "source": self.source, "path": self.path, "lost_version": self.lost_version}


class WeightsRecord:
    """The state file (None: nothing is kept, a restart serves the initial weights)."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = str(path) if path else None
        self.current = ServedWeights()

    def read(self) -> ServedWeights | None:
        if not self.path or not os.path.exists(self.path):
            return None
        try:
            with open(self.path) as f:
                return ServedWeights(**json.load(f))
        except (OSError, ValueError, TypeError) as e:
            log.error("lockstep: the weights record %s is unreadable (%s); serving the initial weights", self.path, e)
            return None

    def write(self, served: ServedWeights) -> None:
        self.current = served
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(served), f)
        os.replace(tmp, self.path)

    def note_update(self, source: str, path: str | None, version: int) -> None:
        """An update applied (the driver's front door calls it from the loop thread)."""
        try:
            self.write(self.current.after_update(source, path, version))
        except OSError as e:  # serving goes on; only a later restart loses these weights
            log.error("lockstep: could not record weight version %d in %s: %s", version, self.path, e)


def restore(manager: Any, record: WeightsRecord) -> ServedWeights:
    """Serve again what rank 0's record says, before the loop starts. Every rank calls it (a collective)."""
    mine = record.read() if manager.groups.is_driver else None
    told = agree_messages(json.dumps(asdict(mine)) if mine else "", manager.groups, MAX_RECORD_BYTES)[0]
    if not told:
        record.current = ServedWeights()
        return record.current
    last = ServedWeights(**json.loads(told))
    served = ServedWeights(0, "initial", None, 0, None, last.lost_version)
    if last.restorable_path:
        try:
            manager.updates.update_weights(last.restorable_path)
            served = ServedWeights(last.restorable_version, "checkpoint", last.restorable_path,
                                   last.restorable_version, last.restorable_path, last.lost_version)
        except WeightUpdateError as e:  # refused on every rank alike: the initial weights stay
            log.error("lockstep: could not reload %s after the restart: %s", last.restorable_path, e)
    if last.version != served.version:
        served.lost_version = last.version
    manager.updates.version = served.version  # every rank holds it: the next update checks it
    if manager.engine is not None:
        manager.engine.weight_version = served.version
    log.info("lockstep: restored weights: %s", served.report())
    if manager.groups.is_driver:
        record.write(served)
    return served
