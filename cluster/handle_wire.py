"""The wire form of an update by handle (`update_weights` with `source = "handles"`; docs/protocol.md): one handle a
bucket, each a map of plain fields (worker/handles.py maps them on every rank). Checked at the front door before any
rank opens anything: a segment name of the trainer's form (no paths), byte counts that match the buckets. Torch-free."""

from __future__ import annotations

import re
from typing import Any

from cluster.protocol import ProtocolError, check_buckets
from cluster.errors import Code

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
SHM_NAME = re.compile(r"^lockstep-w-[0-9a-f]{32}$")  # launch/weight_handles.py's names: nothing else is opened
CUDA_INTS = ("device", "storage_size", "storage_offset", "ref_counter_offset")
CUDA_BYTES = ("handle", "ref_counter_handle")


def _bad(message: str, mid: Any) -> ProtocolError:
    return ProtocolError(Code.BAD_FIELD, message, mid)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62


def bucket_nbytes(bucket: list[list[Any]]) -> int:
    count = 0
    for _, shape, _ in bucket:
        n = 1
        for d in shape:
            n *= d
        count += n
    return count * ITEMSIZE[bucket[0][2]]


def check_handle(h: Any, nbytes: int, b: int, mid: Any) -> dict[str, Any]:
    """One bucket's handle: {"kind": "shm", "name", "nbytes"} or {"kind": "cuda", ...}, `nbytes` the bucket's."""
    if not isinstance(h, dict) or h.get("kind") not in ("shm", "cuda"):
        raise _bad(f"handle {b} must be a map whose kind is 'shm' or 'cuda'", mid)
    if h.get("nbytes") != nbytes or not _is_int(h.get("nbytes")):
        raise _bad(f"handle {b}: nbytes must be its bucket's bytes ({nbytes})", mid)
    if h["kind"] == "shm":
        if not (isinstance(h.get("name"), str) and SHM_NAME.match(h["name"])):
            raise _bad(f"handle {b}: name must be a segment of the form lockstep-w-<32 hex digits>", mid)
        return {"kind": "shm", "name": h["name"], "nbytes": nbytes}
    if not all(_is_int(h.get(k)) for k in CUDA_INTS) or not all(isinstance(h.get(k), bytes) for k in CUDA_BYTES):
        raise _bad(f"handle {b}: a cuda handle needs ints {CUDA_INTS} and bytes {CUDA_BYTES}", mid)
    if not (h.get("event_handle") is None or isinstance(h["event_handle"], bytes)) \
            or not isinstance(h.get("event_sync_required"), bool):
        raise _bad(f"handle {b}: event_handle is bytes or nil, event_sync_required a bool", mid)
    return {k: h[k] for k in ("kind", "nbytes", *CUDA_INTS, *CUDA_BYTES, "event_handle", "event_sync_required")}


def check_handles(buckets: Any, handles: Any, mid: Any = None) -> tuple[list[list[list[Any]]], list[dict[str, Any]]]:
    """(buckets, handles) of an update by handle: buckets as a push's (check_buckets), one handle for each."""
    buckets = check_buckets(buckets, mid)
    if not isinstance(handles, list) or len(handles) != len(buckets):
        raise _bad(f"handles must be a list of one handle per bucket ({len(buckets)})", mid)
    return buckets, [check_handle(h, bucket_nbytes(bk), b, mid) for b, (bk, h) in enumerate(zip(buckets, handles))]
