"""Colocated weight updates by handle: the trainer's side (SGLang's `update_weights_from_tensor`, vLLM's IPC engine).

A trainer on the cluster's host keeps its weights in `SharedBuckets`: flat buckets of one dtype each, in POSIX shared
memory when they are on the CPU and in CUDA memory it shares by IPC handle when they are on a GPU. It may train in
the buckets' views directly (`buckets.tensors`) or `load` new values into them. `update_weights_by_handle` then sends
only the names and one handle a bucket (msgpack of plain fields, worker/handles.py); every rank maps the buckets and
copies its slices into its parameters after the all-or-none vote. The buckets must stay open until the call returns.
Requires torch in the trainer (cluster.Client alone does not)."""

from __future__ import annotations

import uuid
from multiprocessing import shared_memory
from typing import Any

import torch

from cluster import protocol as P
from cluster.client import Client
from cluster.errors import WeightUpdateError
from launch.weight_push import DTYPE_NAMES, bucket_meta, buckets_of
from worker.handles import encode_cuda

SHM_PREFIX = "lockstep-w-"  # segment names; cluster/handle_wire.py accepts only names of this form


class SharedBuckets:
    """`tensors` (name -> tensor, transformers' names) packed into shareable flat buckets of at most `bucket_bytes`
    each (a larger tensor goes alone). `tensors[name]` becomes a view into its bucket; `close()` frees them."""

    def __init__(self, tensors: dict[str, torch.Tensor], bucket_bytes: int = 256 << 20):
        for name, t in tensors.items():
            if t.dtype not in DTYPE_NAMES:
                raise ValueError(f"tensor {name}: dtype {t.dtype} cannot be shared")
        groups = buckets_of(tensors, bucket_bytes)
        self.buckets = bucket_meta(tensors, groups)
        self.handles: list[dict[str, Any]] = []
        self.segments: list[shared_memory.SharedMemory] = []
        self.flats: list[torch.Tensor] = []
        self.tensors: dict[str, torch.Tensor] = {}
        for names in groups:
            first = tensors[names[0]]
            nbytes = sum(tensors[n].numel() for n in names) * first.element_size()
            flat = self._bucket(nbytes, first.device)
            sizes = [tensors[n].numel() for n in names]
            for n, part in zip(names, flat.view(first.dtype).split(sizes)):
                self.tensors[n] = part.view(tensors[n].shape)
            self.flats.append(flat)
        self.load(tensors)

    def _bucket(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.handles.append(encode_cuda(reduce_tensor(flat)))
            return flat
        seg = shared_memory.SharedMemory(name=SHM_PREFIX + uuid.uuid4().hex, create=True, size=max(nbytes, 1))
        self.segments.append(seg)
        self.handles.append({"kind": "shm", "name": seg.name, "nbytes": nbytes})
        return torch.frombuffer(seg.buf, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy new values into the buckets (any subset of the names they hold)."""
        for name, t in tensors.items():
            self.tensors[name].copy_(t)
        for flat in self.flats:
            if flat.is_cuda:
                torch.cuda.current_stream(flat.device).synchronize()  # the ranks read after this returns

    def close(self) -> None:
        """Free the buckets (the views in `tensors` go with them)."""
        self.tensors.clear()
        self.flats.clear()
        for seg in self.segments:
            try:
                seg.close()
            except BufferError:  # a caller still holds a view: the mapping goes with it, the name goes now
                pass
            seg.unlink()
        self.segments.clear()

    def __enter__(self) -> "SharedBuckets":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def update_weights_by_handle(client: Client, shared: SharedBuckets, kv_policy: str = "keep", partial: bool = False,
                             timeout_s: float = 120.0) -> dict[str, Any]:
    """Update the cluster's weights from `shared` (all of the model's tensors, or a subset with `partial`): only
    handles and names travel. Its result, or WeightUpdateError if refused (nothing changed anywhere)."""
    reply = client.io.call(P.UPDATE_WEIGHTS, source="handles", buckets=shared.buckets, handles=shared.handles,
                           kv_policy=kv_policy, partial=partial)
    result = reply.result(timeout_s)["data"]
    if not result.get("ok"):
        raise WeightUpdateError(result.get("error", "refused"), result.get("rank"), result)
    return result
