"""Push new weights from a trainer process into a running cluster (RL loops).

The trainer asks the driver for an update through a normal client, then joins a process group with every serving
rank for this one push (as its last member) and broadcasts its tensors in packed buckets of one dtype each (NCCL
when both ends are on CUDA, else gloo: worker/push.py). The update is applied on every rank or on none. Requires
torch in the trainer (cluster.Client alone does not)."""

from __future__ import annotations

from typing import Any

import torch

from cluster import protocol as P
from cluster.client import Client
from cluster.errors import WeightUpdateError
from launch.torchrun import free_port
from worker.push import TRAINER_DEVICE_KEY, open_store, send_buckets

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def buckets_of(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Names grouped into buckets of one dtype and at most bucket_bytes each (a larger tensor goes alone)."""
    out: list[list[str]] = []
    size, dtype = 0, None
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if not out or t.dtype != dtype or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size, dtype = size + nbytes, t.dtype
    return out


def bucket_meta(tensors: dict[str, torch.Tensor], groups: list[list[str]]) -> list[list[list[Any]]]:
    """The buckets as the update call carries them: [[name, shape, dtype name], ...] per bucket."""
    return [[[n, list(tensors[n].shape), DTYPE_NAMES[tensors[n].dtype]] for n in names] for names in groups]


def push_weights(client: Client, tensors: dict[str, torch.Tensor], kv_policy: str = "keep",
                 bucket_bytes: int = 64 << 20, host: str = "127.0.0.1", timeout_s: float = 120.0,
                 partial: bool = False) -> dict[str, Any]:
    """Send `tensors` (transformers' names; all of the model's, or any subset of them with `partial`) to the
    cluster; its result, or WeightUpdateError if refused. If this side's sends fail (a serving rank gave up on the
    push: its push_timeout_s), the cluster's answer (which names the phase) is still what it raises."""
    for name, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} cannot be pushed")
    device = trainer_device(tensors)
    tp = client.health()["world_size"]
    endpoint = f"{host}:{free_port()}"
    store = open_store(endpoint, tp + 1, timeout_s, master=True)
    try:
        store.set(TRAINER_DEVICE_KEY, device.type)
        groups = buckets_of(tensors, bucket_bytes)
        reply = client.io.call(P.UPDATE_WEIGHTS, source="push", store=endpoint, buckets=bucket_meta(tensors, groups),
                               kv_policy=kv_policy, partial=partial)
        try:
            send_buckets(store, tp, tensors, groups, device, timeout_s, gave_up=reply.done)
        except Exception:
            if not reply_in(reply, timeout_s):  # no answer either: this side's failure is all there is
                raise
        result = reply.result(timeout_s)["data"]
    finally:
        del store  # the TCPStore server (and its thread) goes with the last reference
    if not result.get("ok"):
        raise WeightUpdateError(result.get("error", "refused"), result.get("rank"), result)
    return result


def reply_in(reply: Any, timeout_s: float) -> bool:
    """Whether the cluster's reply came within `timeout_s` (a failed one counts: it is the cluster's word)."""
    try:
        reply.result(timeout_s)
    except Exception:
        return reply.done()
    return True


def trainer_device(tensors: dict[str, torch.Tensor]) -> torch.device:
    """The trainer's side of the backend choice: CUDA when every tensor is on CUDA, else the CPU (gloo)."""
    devices = {t.device for t in tensors.values()}
    if devices and all(d.type == "cuda" for d in devices):
        return next(iter(tensors.values())).device
    return torch.device("cpu")
