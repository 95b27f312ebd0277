"""Hot weight updates on every rank: stage the new shard, agree, then copy in place (all or none).

Sources: a checkpoint directory (each rank reads its own slices), tensors in this process (inside a pause), or
a trainer's push over a separate update group (worker/push.py). Whatever the source, no rank copies a byte
before every rank has staged its shard without error; one failure anywhere leaves every rank on the old
weights, and the error names the rank and the problem."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cluster import faults
from cluster.dist import DRIVER, Groups, agree_all_ok, agree_messages
from cluster.errors import Code, LockstepError, WeightRefused
from worker.handles import stage_handles
from worker.loader import Staged, apply, stage_checkpoint, stage_named
from worker.models.decoder import CausalLM
from worker.push import stage_pushed


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

    source: str  # "checkpoint" | "push" | "tensors" | "handles"
    path: str = ""
    kv_policy: str = "keep"
    store: str = ""  # push: host:port of the trainer's TCPStore
    buckets: list[list[list[Any]]] = field(default_factory=list)  # push, handles: [[name, shape, dtype], ...] a bucket
    timeout_s: float = 120.0  # push: push_timeout_s, how long any member may stay silent before every rank gives up
    partial: bool = False  # a subset of the model's tensors (each name the model's); the others stay as they are
    handles: list[dict[str, Any]] = field(default_factory=list)  # handles: one per bucket (worker/handles.py)
    callers: bool = True  # every rank's user thread waits for this update (False: the front door's, driver only)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


VOTE_TEXT_CHARS = 600  # a vote's text is cut to this, so its JSON fits agree_messages' bytes


def vote_of(e: BaseException) -> str:
    """An exception as this rank's vote against: JSON of {text, code, tensor, phase} (plain data, never empty)."""
    fields = {"text": described(e)[:VOTE_TEXT_CHARS], "code": Code.WEIGHT_UPDATE_FAILED, "tensor": None, "phase": None}
    if isinstance(e, WeightRefused):
        fields |= {"code": e.code, "tensor": e.tensor and e.tensor[:200], "phase": e.phase}
    return json.dumps(fields)


def read_vote(text: str) -> dict[str, Any]:
    try:
        vote = json.loads(text)
    except ValueError:  # cut short: keep what it says
        vote = None
    return vote if isinstance(vote, dict) else {"text": text, "code": Code.WEIGHT_UPDATE_FAILED}


def refusals(ok: bool, vote: str, groups: Groups) -> list[tuple[int, dict[str, Any]]]:
    """(rank, vote) of every rank that votes against: an explicit flag per rank, plus its vote (`vote_of`). Every
    rank of the control group calls it (two collectives). A rank that votes against with no text still votes
    against."""
    flags = agree_all_ok(ok, groups)
    texts = agree_messages("" if ok else (vote or vote_of(ValueError())), groups)
    return [(rank, read_vote(text)) for rank, (flag, text) in enumerate(zip(flags, texts)) if not flag]


def refused_result(refused: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """The result of a refused update: every refusing rank's text, and the first one's rank, code, tensor, phase."""
    first, vote = refused[0]
    return {"ok": False, "error": "; ".join(f"rank {r}: {v.get('text', '')}" for r, v in refused), "rank": first,
            "reason_code": vote.get("code") or Code.WEIGHT_UPDATE_FAILED, "tensor": vote.get("tensor"),
            "phase": vote.get("phase")}


def driver_value(value: int, groups: Groups) -> int:
    """The driver's `value` on every rank. Every rank of the control group calls it (one all-reduce)."""
    if not groups.distributed:
        return value
    t = torch.tensor([value if groups.rank == DRIVER else 0], dtype=torch.int64)
    dist.all_reduce(t, group=groups.control_group)
    return int(t.item())


def described(e: BaseException) -> str:
    """An exception as vote text; never empty, even when its message is."""
    text = str(e)
    if isinstance(e, ValueError) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else f"{type(e).__name__} (no message)"


def stage(model: CausalLM, groups: Groups, call: UpdateCall, local: dict[str, torch.Tensor] | None) -> Staged:
    """This rank's new shard, read and checked, model untouched. Every serving rank calls it (push: collectives)."""
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
    raise ValueError(f"unknown weight source {call.source!r}")


def run_update(model: CausalLM, groups: Groups, call: UpdateCall, local: dict[str, torch.Tensor] | None = None,
               version: int = 0, expected: int | None = None, attempt: int = 0) -> dict[str, Any]:
    """Stage on this rank, vote, copy everywhere or nowhere, then vote again that every rank copied. Every rank
    calls it at the same step boundary (the loops after a CALL plan, or every caller inside a pause). `version`:
    the weight version this rank holds; `expected`: the CALL plan's (None in a pause: the driver's is fetched).
    A refused update returns {"ok": False, "error", "rank" (the first refusing)} and changes nothing; a rank
    failing while copying makes every rank raise WeightsDiverged. `attempt`: this rank's count (fault rules)."""
    start = time.perf_counter()
    if expected is None:
        expected = driver_value(version, groups)
    ok, vote, staged = True, "", []
    try:
        staged = stage(model, groups, call, local)
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
    return {"ok": True, "tensors": len(staged), "seconds": time.perf_counter() - start}
