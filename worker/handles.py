"""Updates by handle from a trainer on the same host (SGLang's `update_weights_from_tensor`, vLLM's IPC engine): the
trainer packs its tensors into flat buckets of one dtype each (launch/weight_handles.py) and sends only a handle per
bucket and the names; every rank maps each bucket and stages views of its own slices (no copy), so the one copy is
`apply`'s, straight into the parameters, after the all-or-none vote.

A handle is a msgpack map of plain fields, never a pickle:

- `{"kind": "shm", "name", "nbytes"}`: a POSIX shared-memory segment (`/dev/shm/<name>`), the CPU's path;
- `{"kind": "cuda", "device", "handle", "storage_size", "storage_offset", "ref_counter_handle",
  "ref_counter_offset", "event_handle", "event_sync_required", "nbytes"}`: the fields of
  `torch.multiprocessing.reductions.reduce_tensor` for a flat uint8 CUDA tensor, rebuilt here by the same
  module's `rebuild_cuda_tensor` (CUDA IPC; the device index is the trainer's, which must name the same GPU here).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import torch

from cluster.errors import Code, WeightRefused
from worker.loader import Staged, stage_named
from worker.mapped_checkpoint import read_only_view
from worker.models.decoder import CausalLM

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SHM_DIR = "/dev/shm"
CUDA_FIELDS = ("device", "handle", "storage_size", "storage_offset", "ref_counter_handle", "ref_counter_offset",
               "event_handle", "event_sync_required")


def encode_cuda(reduced: tuple[Any, tuple]) -> dict[str, Any]:
    """The handle of a flat uint8 CUDA tensor from `reduce_tensor(flat)` = (rebuild_cuda_tensor, args), as plain
    fields (the args' classes and dtype are implied: a contiguous uint8 tensor at offset 0 of its storage)."""
    _, (_, size, stride, offset, _, dtype, *fields) = reduced
    if dtype != torch.uint8 or len(size) != 1 or tuple(stride) != (1,) or offset != 0:
        raise ValueError("a CUDA bucket handle is of a whole flat uint8 tensor")
    device, handle, storage_size, storage_offset, rc_handle, rc_offset, event, sync = (
        fields[0], fields[1], fields[2], fields[3], fields[5], fields[6], fields[7], fields[8])  # fields[4]: grad
    return {"kind": "cuda", "nbytes": int(size[0]), "device": int(device), "handle": bytes(handle),
            "storage_size": int(storage_size), "storage_offset": int(storage_offset),
            "ref_counter_handle": bytes(rc_handle), "ref_counter_offset": int(rc_offset),
            "event_handle": None if event is None else bytes(event), "event_sync_required": bool(sync)}


def cuda_rebuild_args(h: dict[str, Any]) -> tuple:
    """`rebuild_cuda_tensor`'s arguments for a handle made by `encode_cuda` (the inverse of its packing)."""
    return (torch.Tensor, torch.Size([h["nbytes"]]), (1,), 0, torch.storage.TypedStorage, torch.uint8, h["device"],
            h["handle"], h["storage_size"], h["storage_offset"], False, h["ref_counter_handle"],
            h["ref_counter_offset"], h["event_handle"], h["event_sync_required"])


def open_cuda(h: dict[str, Any]) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*cuda_rebuild_args(h))


def open_shm(h: dict[str, Any]) -> torch.Tensor:
    """The segment as a flat uint8 tensor over a read-only shared mapping of it, its pages mapped in one pass
    (MAP_POPULATE; a private writable mapping would copy them). Nothing writes it. The mapping lives as long as
    the tensor (and its views)."""
    fd = os.open(os.path.join(SHM_DIR, h["name"]), os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < h["nbytes"]:
            raise ValueError(f"shared memory {h['name']!r} holds {os.fstat(fd).st_size} bytes, "
                             f"the handle says {h['nbytes']}")
        return read_only_view(fd, h["nbytes"])
    finally:
        os.close(fd)


def open_bucket(h: dict[str, Any]) -> torch.Tensor:
    """A bucket's bytes, mapped from its handle."""
    if h["kind"] == "shm":
        return open_shm(h)
    if h["kind"] == "cuda":
        return open_cuda(h)
    raise ValueError(f"unknown handle kind {h['kind']!r}")


def bucket_tensors(buckets: list[list[list[Any]]], handles: list[dict[str, Any]]) -> Iterator[tuple[str, Any]]:
    """(name, view) of every tensor of every bucket, the views into the mapped buckets."""
    for b, (bucket, h) in enumerate(zip(buckets, handles, strict=True)):
        dtype = DTYPES[bucket[0][2]]
        sizes = [int(torch.Size(shape).numel()) for _, shape, _ in bucket]
        need = sum(sizes) * dtype.itemsize
        try:
            flat = open_bucket(h)
        except (OSError, RuntimeError, ValueError) as e:
            raise WeightRefused(f"bucket {b}: its handle cannot be opened: {type(e).__name__}: {e}",
                                Code.WEIGHT_UPDATE_FAILED, phase=f"bucket {b + 1}/{len(buckets)}") from None
        if flat.numel() < need:
            raise WeightRefused(f"bucket {b}: {flat.numel()} bytes, its tensors need {need}",
                                Code.SHAPE_MISMATCH, tensor=bucket[0][0])
        for (name, shape, _), part in zip(bucket, flat[:need].view(dtype).split(sizes)):
            yield name, part.view(shape)


def stage_handles(model: CausalLM, buckets: list[list[list[Any]]], handles: list[dict[str, Any]],
                  partial: bool) -> Staged:
    """This rank's slices of the trainer's buckets, as views (no copy); checked like any update (names, shapes,
    all of them unless `partial`). The views keep the mappings until the staged list is dropped."""
    return stage_named(model, bucket_tensors(buckets, handles), "handles", partial, copy=False)
