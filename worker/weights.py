"""Hot weight updates on every rank: stage the new shard, agree, then copy in place (all or none).

Sources: a checkpoint directory (each rank reads its own slices), tensors in this process (inside a pause), or
a trainer's push over a separate update group (worker/push.py). Whatever the source, no rank copies a byte
before every rank has staged its shard without error; one failure anywhere leaves every rank on the old
weights, and the error names the rank and the problem."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cluster import faults
from cluster.dist import DRIVER, Groups
from cluster.errors import Code, LockstepError
from worker.handles import stage_handles
from worker.loader import Staged, apply, stage_checkpoint, stage_named
from worker.models.decoder import CausalLM
from worker.push import stage_pushed
from worker.trainer_groups import TrainerGroups
from worker.votes import refusals, refused_result, vote_of


class WeightsDiverged(LockstepError, RuntimeError):
    """A rank failed while copying new weights in: the ranks no longer hold the same weights. Unrecoverable
    for this group; every rank raises it at the same point, which ends the manager's loop."""

    code = Code.WEIGHTS_DIVERGED

    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


@dataclass
class UpdateCall:
    """What every rank must do, as plain data (it travels in a CALL plan as msgpack)."""

    source: str  # "checkpoint" | "push" | "tensors" | "handles" | "group"
    path: str = ""
    kv_policy: str = "keep"
    store: str = ""  # push: host:port of the trainer's TCPStore
    buckets: list[list[list[Any]]] = field(default_factory=list)  # push, handles: [[name, shape, dtype], ...] a bucket
    timeout_s: float = 120.0  # push: push_timeout_s, how long any member may stay silent before every rank gives up
    partial: bool = False  # a subset of the model's tensors (each name the model's); the others stay as they are
    handles: list[dict[str, Any]] = field(default_factory=list)  # handles: one per bucket (worker/handles.py)
    callers: bool = True  # every rank's user thread waits for this update (False: the front door's, driver only)
    group_name: str = ""  # group: the trainer's group a bucket comes over (worker/trainer_groups.py)
    load_format: str | None = None  # group: None (a broadcast a tensor) or "flattened_bucket"
    end: bool = False  # group: this bucket ends the update (what is staged applies, a subset as a partial update)
    apply: bool = True  # group: this bucket's update applies now (the driver decides: complete, or `end`)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def driver_value(value: int, groups: Groups) -> int:
    """The driver's `value` on every rank. Every rank of the control group calls it (one all-reduce)."""
    if not groups.distributed:
        return value
    t = torch.tensor([value if groups.rank == DRIVER else 0], dtype=torch.int64)
    dist.all_reduce(t, group=groups.control_group)
    return int(t.item())


def stage(model: CausalLM, groups: Groups, call: UpdateCall, local: dict[str, torch.Tensor] | None,
          trainer: TrainerGroups | None = None) -> Staged:
    """This rank's new shard, read and checked, model untouched. Every serving rank calls it (push, group:
    collectives). `trainer`: this rank's trainer-owned groups (group: the update staged so far, with this bucket)."""
    if call.source == "checkpoint":
        return stage_checkpoint(model, call.path, call.partial)
    if call.source == "push":
        return stage_pushed(model, groups.rank, groups.world_size, groups.device, call)
    if call.source == "tensors":
        if local is None:
            raise ValueError("no tensors were handed to this rank")
        return stage_named(model, local.items(), "tensors", call.partial)
    if call.source == "handles":
        return stage_handles(model, call.buckets, call.handles, call.partial)
    if call.source == "group" and trainer is not None:
        return trainer.stage_bucket(model, groups, call.group_name, call.buckets[0], call.load_format)
    raise ValueError(f"unknown weight source {call.source!r}")


def run_update(model: CausalLM, groups: Groups, call: UpdateCall, local: dict[str, torch.Tensor] | None = None,
               version: int = 0, expected: int | None = None, attempt: int = 0,
               trainer: TrainerGroups | None = None) -> dict[str, Any]:
    """Stage on this rank, vote, copy everywhere or nowhere, then vote again that every rank copied. Every rank
    calls it at the same step boundary (the loops after a CALL plan, or every caller inside a pause). `version`:
    the weight version this rank holds; `expected`: the CALL plan's (None in a pause: the driver's is fetched).
    A refused update returns {"ok": False, "error", "rank" (the first refusing)} and changes nothing; a rank
    failing while copying makes every rank raise WeightsDiverged. `attempt`: this rank's count (fault rules). A
    trainer group's bucket whose update does not end with it (`call.apply` false) stops after the vote: {"ok": True,
    "applied": False, "staged"} (the tensors staged so far stay with `trainer` for the bucket that ends it)."""
    start = time.perf_counter()
    if expected is None:
        expected = driver_value(version, groups)
    ok, vote, staged = True, "", []
    try:
        staged = stage(model, groups, call, local, trainer)
        faults.hit("stage_weights", rank=groups.rank, attempt=attempt)
        try:
            faults.hit("stage_weights_silent", rank=groups.rank, attempt=attempt)
        except faults.InjectedFault:
            raise ValueError() from None  # an exception whose message is empty must still vote against
        if version != expected:
            raise ValueError(f"this rank holds weight version {version}, the plan carries {expected}")
    except Exception as e:  # any failure becomes this rank's vote against
        ok, vote = False, vote_of(e)
    refused = refusals(ok, vote, groups)
    if refused:
        return refused_result(refused) | {"seconds": time.perf_counter() - start}
    if not call.apply:
        return {"ok": True, "applied": False, "staged": len(staged), "seconds": time.perf_counter() - start}
    ok, vote = True, ""
    try:
        half = len(staged) // 2
        apply(staged[:half])
        faults.hit("apply_weights", rank=groups.rank, attempt=attempt)
        apply(staged[half:])
    except Exception as e:
        ok, vote = False, vote_of(e)
    failed = refusals(ok, vote, groups)
    if failed:
        raise WeightsDiverged("weights now differ across ranks (a rank failed while copying): "
                              + "; ".join(f"rank {r}: {v.get('text', '')}" for r, v in failed), [r for r, _ in failed])
    return {"ok": True, "applied": True, "tensors": len(staged), "seconds": time.perf_counter() - start}
