"""A weight-sync group the trainer owns, on the wire (docs/protocol.md, "A weight-sync group the trainer owns"): the
`weights_group` kind (SGLang's `/init_weights_update_group` and `/destroy_weights_update_group`, vLLM's and OpenRLHF's
`init_process_group`) and `update_weights` with `source = "group"` (SGLang's `/update_weights_from_distributed`).
Field names and defaults are SGLang's (python/sglang/srt/managers/io_struct.py: InitWeightsUpdateGroupReqInput,
DestroyWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput); every rank dials the trainer's address, so
this is admin-only and checked here before any rank acts. Torch-free."""

from __future__ import annotations

from typing import Any

from cluster.handle_wire import bucket_nbytes
from cluster.protocol import ProtocolError, _is_host, check_buckets, field
from cluster.errors import Code

GROUP_ACTIONS = ("init", "destroy")
GROUP_BACKENDS = ("gloo", "nccl")  # gloo: the trainer's tensors on the CPU; nccl: on CUDA, as the ranks
DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default
LOAD_FORMATS = ("flattened_bucket",)  # else (none) one broadcast a tensor, in `names` order
MAX_GROUP_NAME_CHARS = 256
MAX_BUCKET_BYTES = 1 << 36  # one call's tensors: every rank allocates them (a bucket) before receiving


def _bad(message: str, mid: Any) -> ProtocolError:
    return ProtocolError(Code.BAD_FIELD, message, mid)


def group_name(msg: dict) -> str:
    """`group_name`: SGLang's default when absent, else 1..256 characters."""
    name = field(msg, "group_name", str, DEFAULT_GROUP_NAME)
    if not 0 < len(name) <= MAX_GROUP_NAME_CHARS:
        raise _bad(f"group_name must have 1 to {MAX_GROUP_NAME_CHARS} characters", msg.get("mid"))
    return name


def check_group_call(msg: dict, tp: int) -> dict[str, Any]:
    """A `weights_group` message as GroupCall's fields (worker/trainer_groups.py). `init`: `master_address` (a
    hostname or IP literal), `master_port` (1..65535), `rank_offset` and `world_size` with the trainer at rank 0, so
    1 <= rank_offset and rank_offset + tp <= world_size (this engine's tp ranks join at rank_offset + r),
    `backend` gloo or nccl (SGLang's default nccl); `destroy`: `group_name` alone."""
    mid = msg.get("mid")
    action = field(msg, "action", str, required=True)
    if action not in GROUP_ACTIONS:
        raise _bad(f"action must be one of {', '.join(GROUP_ACTIONS)}", mid)
    call: dict[str, Any] = {"action": action, "group_name": group_name(msg)}
    if action == "destroy":
        return call
    host = field(msg, "master_address", str, required=True)
    if not _is_host(host):
        raise _bad("master_address must be a hostname or an IP literal", mid)
    port, offset, world = (field(msg, k, int, required=True) for k in ("master_port", "rank_offset", "world_size"))
    if not 0 < port < 65536:
        raise _bad("master_port must be in 1..65535", mid)
    if not (1 <= offset and offset + tp <= world):
        raise _bad(f"rank_offset={offset}, world_size={world}: the trainer is rank 0 and this engine's {tp} rank(s) "
                   f"join at rank_offset.. rank_offset + {tp - 1}, so 1 <= rank_offset <= world_size - {tp}", mid)
    backend = field(msg, "backend", str, "nccl")
    if backend not in GROUP_BACKENDS:
        raise _bad(f"backend must be one of {', '.join(GROUP_BACKENDS)}", mid)
    return call | {"master_address": host.strip("[]"), "master_port": port, "rank_offset": offset,
                   "world_size": world, "backend": backend}


def check_group_bucket(msg: dict) -> tuple[str, list[list[Any]], str | None, bool]:
    """An `update_weights` with source "group": (group_name, one bucket of [name, shape, dtype], load_format, end).
    `names`, `dtypes`, `shapes`: SGLang's three lists, of one length, each dtype one of float32, float16, bfloat16
    (a bucket may mix them), at most MAX_BUCKET_BYTES in all; `load_format` none or "flattened_bucket"; `end`
    (Lockstep's) ends the update with this call."""
    mid = msg.get("mid")
    names, dtypes, shapes = (field(msg, k, list, required=True) for k in ("names", "dtypes", "shapes"))
    if not names or not len(names) == len(dtypes) == len(shapes):
        raise _bad("names, dtypes and shapes must be lists of one non-zero length", mid)
    entries = [[n, s, d] for n, s, d in zip(names, shapes, dtypes)]
    bucket = [e for one in check_buckets([[e] for e in entries], mid) for e in one]  # a dtype a tensor
    if sum(bucket_nbytes([e]) for e in bucket) > MAX_BUCKET_BYTES:
        raise _bad(f"the tensors of one call hold more than {MAX_BUCKET_BYTES} bytes", mid)
    load_format = field(msg, "load_format", str)
    if load_format is not None and load_format not in LOAD_FORMATS:
        raise _bad(f"load_format must be none or one of {', '.join(LOAD_FORMATS)}", mid)
    return group_name(msg), bucket, load_format, field(msg, "end", bool, False)

