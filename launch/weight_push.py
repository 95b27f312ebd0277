"""Push new weights from a trainer process into a running cluster (RL loops).

The trainer asks the driver for an update through a normal client, then joins a separate process group with
every serving rank (it is the last member; gloo on CPU, NCCL on CUDA) and broadcasts its tensors in packed
buckets of one dtype each. Every serving rank takes its own shard of each tensor, and the update is applied
on every rank or on none. Requires torch in the trainer (cluster.Client alone does not).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cluster import protocol as P
from cluster.client import Client
from cluster.errors import WeightUpdateError
from launch.torchrun import free_port
from worker.weights import agree_flag, broadcast

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def buckets_of(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Names grouped into buckets of one dtype and at most bucket_bytes each (a larger tensor goes alone)."""
    out: list[list[str]] = []
    current: list[str] = []
    size, dtype = 0, None
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and (t.dtype != dtype or size + nbytes > bucket_bytes):
            out.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
        dtype = t.dtype
    if current:
        out.append(current)
    return out


def push_weights(client: Client, tensors: dict[str, torch.Tensor], kv_policy: str = "keep",
                 bucket_bytes: int = 64 << 20, host: str = "127.0.0.1", timeout_s: float = 120.0) -> dict[str, Any]:
    """Send `tensors` (full, unsharded, transformers' names) to the cluster behind `client`; returns the
    driver's result ({"ok": True, "version", ...}), or raises WeightUpdateError (rank and reason in it) when
    the cluster refused the update."""
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} cannot be pushed")
    tp = client.health()["world_size"]
    world = tp + 1
    port = free_port()
    store = dist.TCPStore(host, port, world, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    groups = buckets_of(tensors, bucket_bytes)
    meta = [[[n, list(tensors[n].shape), DTYPE_NAMES[tensors[n].dtype]] for n in names] for names in groups]
    reply = client.io.call(P.UPDATE_WEIGHTS, source="push", store=f"{host}:{port}", buckets=meta,
                           kv_policy=kv_policy)
    pg = dist.ProcessGroupGloo(store, tp, world, timedelta(seconds=timeout_s))
    if agree_flag(pg, True):
        for names in groups:
            flat = torch.cat([tensors[n].detach().reshape(-1).cpu() for n in names])
            broadcast(pg, flat, root=tp)
    result = reply.result(timeout_s)["data"]
    del store
    if not result.get("ok"):
        raise WeightUpdateError(result.get("error", "refused"), result.get("rank"), result)
    return result
