"""Hot weight updates on every rank: stage the new shard, agree, then copy in place (all or none).

Sources: a checkpoint directory (each rank reads its own slices), tensors in this process (inside a pause),
or tensors pushed by a trainer process that joins a separate update group (gloo on CPU, NCCL on GPU) and
broadcasts them in packed buckets. Whatever the source, no rank copies a byte before every rank has staged
its shard without error; one failure anywhere leaves every rank on the old weights, and the error names the
rank and the problem.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cluster.dist import Groups, agree_messages
from worker.loader import Staged, apply, stage_checkpoint, stage_named
from worker.model import CausalLM

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class UpdateCall:
    """What every rank must do, as plain data (it travels in a CALL plan as msgpack)."""

    source: str  # "checkpoint" | "push" | "tensors"
    path: str = ""
    kv_policy: str = "keep"
    store: str = ""  # push: host:port of the trainer's TCPStore
    buckets: list[list[list[Any]]] = field(default_factory=list)  # push: [[name, shape, dtype], ...] per bucket
    timeout_s: float = 120.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def update_group(store_addr: str, rank: int, world: int, timeout_s: float, device: torch.device) -> Any:
    """A process group of the serving ranks (0..tp-1) and the trainer (rank tp), outside the default group."""
    host, port = store_addr.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world, is_master=False, timeout=timedelta(seconds=timeout_s))
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world, timedelta(seconds=timeout_s))
    return dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))


def broadcast(pg: Any, tensor: torch.Tensor, root: int) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    pg.broadcast([tensor], opts).wait()


def agree_flag(pg: Any, ok: bool) -> bool:
    """True when every member of `pg` (trainer included) says ok."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    pg.allreduce([flag]).wait()
    return int(flag.item()) == 0


def stage_pushed(model: CausalLM, groups: Groups, call: UpdateCall) -> Staged:
    """Receive the trainer's buckets. Every serving rank calls it, the trainer runs `cluster.weight_push`."""
    world = groups.world_size + 1
    pg = update_group(call.store, groups.rank, world, call.timeout_s, groups.device)
    trainer = world - 1
    expected = model.expected_tensors()
    names = {entry[0] for bucket in call.buckets for entry in bucket}
    problem = ""
    if expected - names:
        problem = f"the push lacks {len(expected - names)} tensor(s), e.g. {sorted(expected - names)[:3]}"
    if not agree_flag(pg, not problem):
        raise ValueError(problem or "another member of the update group refused the push")
    pairs = []
    for bucket in call.buckets:
        dtype = DTYPES[bucket[0][2]]
        sizes = [int(torch.Size(shape).numel()) for _, shape, _ in bucket]
        flat = torch.empty(sum(sizes), dtype=dtype, device=groups.device)
        broadcast(pg, flat, trainer)
        for (name, shape, _), part in zip(bucket, flat.split(sizes)):
            pairs.append((name, part.view(shape)))
    return stage_named(model, pairs, "pushed weights")


def run_update(model: CausalLM, groups: Groups, call: UpdateCall, local: dict[str, torch.Tensor] | None = None
               ) -> dict[str, Any]:
    """Stage on this rank, agree with every rank, apply everywhere or nowhere. Every rank calls it at the same
    step boundary (the driver's loop after a CALL plan, or every caller inside a pause)."""
    start = time.perf_counter()
    error, staged = "", []
    try:
        if call.source == "checkpoint":
            staged = stage_checkpoint(model, call.path)
        elif call.source == "push":
            staged = stage_pushed(model, groups, call)
        elif call.source == "tensors":
            if local is None:
                raise ValueError("no tensors were handed to this rank")
            staged = stage_named(model, local.items(), "tensors")
        else:
            raise ValueError(f"unknown weight source {call.source!r}")
    except Exception as e:  # any failure becomes this rank's vote against
        error = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
    messages = agree_messages(error, groups)
    failed = [f"rank {r}: {m}" for r, m in enumerate(messages) if m]
    if failed:
        return {"ok": False, "error": "; ".join(failed), "seconds": time.perf_counter() - start}
    apply(staged)
    return {"ok": True, "tensors": len(staged), "seconds": time.perf_counter() - start}
