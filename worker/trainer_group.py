"""One serving rank's membership of a weight-sync group the trainer owns (SGLang's `init_weights_update_group`, vLLM's
and OpenRLHF's `init_process_group(master_address, master_port, rank_offset, world_size, group_name, backend)`), and
one bucket received over it.

The trainer is rank 0 and the master of the group's store; this engine's TP rank r joins as rank_offset + r
(SGLang's model_runner: `rank = rank_offset + self.tp_rank`). The trainer makes its side with torch's own recipe
(slime's and OpenRLHF's `init_process_group`, SGLang's `init_custom_process_group`: `rendezvous("tcp://addr:port")`,
a `PrefixStore(group_name)` around its store, then `_new_process_group_helper`), so a rank makes its backend on the
same keys: `group_name`, then `group_name/`, then the backend's first device (`cpu/` for gloo, `cuda/` for nccl),
as that helper lays them out when one backend serves every device (torch 2.13's distributed_c10d). The group is
registered nowhere in torch (threads of one process may each be a rank) and lives until it is destroyed.

A bucket (SGLang's `update_weights_from_distributed`) is broadcast from the trainer either one tensor at a time in
`names` order (slime's and SGLang's default: `dist.broadcast(param, 0, group)` a tensor) or, with load_format
"flattened_bucket", as one uint8 tensor of every tensor's bytes in order (SGLang's FlattenedTensorBucket). Every
wait is bounded by push_timeout_s (worker/push_phase.py names the phase where one gave up)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from worker.push import DTYPES, backend_device, broadcast, close_backend, open_backend
from worker.push_phase import PushPhase

TRAINER = 0  # the trainer's rank in its group: the source of every broadcast


@dataclass
class GroupCall:
    """A `weights_group` call every rank runs from a CALL plan (plain data, msgpack): join ("init") or leave
    ("destroy") the trainer's group `group_name` (cluster/group_wire.py checks the fields)."""

    action: str  # "init" | "destroy"
    group_name: str
    master_address: str = ""
    master_port: int = 0
    rank_offset: int = 1
    world_size: int = 0
    backend: str = "nccl"
    timeout_s: float = 30.0  # push_timeout_s: the rendezvous's bound

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def store_url(address: str, port: int) -> str:
    """The trainer's store as torch's rendezvous names it (an IPv6 literal in brackets)."""
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def group_store(store: Any, group_name: str, backend: str) -> Any:
    """The keys torch's init_process_group recipe gives a group `group_name` of `backend` on `store` (above)."""
    device = dist.Backend.backend_capability[backend][0]
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))


class TrainerGroup:
    """This rank's member of the trainer's group `call.group_name`, at rank `call.rank_offset + tp_rank`. Made by
    every serving rank at once (the rendezvous waits for the trainer and every engine rank, at most
    `call.timeout_s`); `close` leaves it."""

    def __init__(self, call: GroupCall, tp_rank: int, device: torch.device):
        if call.backend == "nccl" and device.type != "cuda":
            raise ValueError(f"backend nccl needs CUDA ranks; this rank is on {device.type} (ask for gloo)")
        self.name, self.backend, self.timeout_s = call.group_name, call.backend, call.timeout_s
        self.rank, self.world_size = call.rank_offset + tp_rank, call.world_size
        self.device = backend_device(call.backend, device)  # where received tensors live (gloo: the CPU)
        self.broken = False  # a wait on it broke: the trainer is gone or out of step, the group is left
        timeout = timedelta(seconds=call.timeout_s)
        store, _, _ = next(dist.rendezvous(store_url(call.master_address, call.master_port), self.rank,
                                           self.world_size, timeout=timeout))
        store.set_timeout(timeout)
        self.store = store
        self.pg = open_backend(group_store(store, self.name, self.backend), self.rank, self.world_size,
                               self.backend, self.device, call.timeout_s)
        if hasattr(self.pg, "_set_sequence_number_for_group"):
            self.pg._set_sequence_number_for_group()  # as the trainer's helper does after making its backend

    def receive(self, bucket: list[list[Any]], load_format: str | None,
                phase: PushPhase) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of `bucket` ([name, shape, dtype] each) from the trainer, as (name, tensor) in order: one
        broadcast a tensor, or one of the flattened bytes. Every member of the group calls it (the trainer
        broadcasts; ranks rank_offset.. receive); each wait is bounded by the group's timeout."""
        phase.enter(f"bucket of {len(bucket)} tensor(s)")
        try:
            return self._receive(bucket, load_format)
        except Exception:
            self.broken = True
            raise

    def _receive(self, bucket: list[list[Any]], load_format: str | None) -> list[tuple[str, torch.Tensor]]:
        if load_format == "flattened_bucket":
            sizes = [torch.Size(shape).numel() * DTYPES[dtype].itemsize for _, shape, dtype in bucket]
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            broadcast(self.pg, flat, TRAINER, self.timeout_s)
            parts = flat.split(sizes)
            return [(name, typed(part, DTYPES[dtype], shape)) for (name, shape, dtype), part in zip(bucket, parts)]
        out = []
        for name, shape, dtype in bucket:
            tensor = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
            broadcast(self.pg, tensor, TRAINER, self.timeout_s)
            out.append((name, tensor))
        return out

    def close(self) -> None:
        """Leave the group (after a wait that broke, `broken`: an NCCL communicator is aborted, not shut down)."""
        close_backend(self.pg, self.backend, self.broken)
        self.pg = self.store = None


def typed(part: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor's bytes in a flattened bucket as that tensor (copied first when its offset does not suit `dtype`)."""
    aligned = part if part.storage_offset() % dtype.itemsize == 0 else part.clone()
    return aligned.view(dtype).view(shape)
