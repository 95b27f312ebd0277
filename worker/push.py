"""The trainer's weight push, as both ends of it run: one backend, a handshake, bounded staging, teardown.

A push is a process group of the serving ranks (0..tp-1) and the trainer (rank tp), made for one push on the
trainer's TCPStore and torn down after it. Before any group exists the trainer posts its device type in the store
and every rank a verdict {device, backend, error}; `agreed_backend` gives every member the same answer, and a
refused push makes no group, so nobody waits on a peer that will not come. Buckets then come one at a time into
one reusable receive buffer (staging memory: a rank's shard plus one bucket)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cluster import faults
from cluster.errors import Code, WeightRefused
from worker.loader import Staged, stage_named, stage_one
from worker.memory import use_device
from worker.models.decoder import CausalLM
from worker.push_phase import PushPhase

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TRAINER_DEVICE_KEY = "push/trainer_device"


def push_backend(rank_device_type: str, trainer_device_type: str) -> str:
    """The update group's backend: "nccl" when the ranks and the trainer both hold CUDA tensors, else "gloo"."""
    return "nccl" if rank_device_type == "cuda" and trainer_device_type == "cuda" else "gloo"


def backend_device(backend: str, local: torch.device) -> torch.device:
    """Where tensors sent over a group of `backend` must live on this member (`local`: its own device)."""
    return local if backend == "nccl" else torch.device("cpu")


def verdict_key(rank: int) -> str:
    return f"push/verdict/{rank}"


def agreed_backend(verdicts: list[dict[str, str]], trainer_device_type: str) -> tuple[str, str]:
    """(backend, "") when every rank's verdict is clean and they agree; ("", why) otherwise. Every member of a
    push (ranks and trainer) calls it on the same verdicts, so all take the same branch."""
    problems = [f"rank {r}: {v['error']}" for r, v in enumerate(verdicts) if v["error"]]
    if problems:
        return "", "; ".join(problems)
    for r, v in enumerate(verdicts):
        expected = push_backend(v["device"], trainer_device_type)
        if v["backend"] != expected:
            return "", (f"rank {r}: backend mismatch: it offered {v['backend']}, but a rank on {v['device']} and a "
                        f"trainer on {trainer_device_type} push over {expected}")
    if len({v["backend"] for v in verdicts}) > 1:
        return "", "the ranks disagree on the push backend: " + ", ".join(
            f"rank {r} {v['backend']} ({v['device']})" for r, v in enumerate(verdicts))
    return verdicts[0]["backend"], ""


def read_verdicts(store: Any, tp: int) -> list[dict[str, str]]:
    """Every rank's posted verdict (blocks up to the store's timeout for the missing ones)."""
    return [json.loads(store.get(verdict_key(r))) for r in range(tp)]


def open_store(addr: str, world: int, timeout_s: float, master: bool = False) -> Any:
    host, port = addr.rsplit(":", 1)
    return dist.TCPStore(host, int(port), world, is_master=master, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


NCCL_WATCHDOG_SLACK_S = 30.0  # NCCL's own watchdog (which may end the process) fires this long after our waits


def open_backend(store: Any, rank: int, world: int, backend: str, device: torch.device, timeout_s: float) -> Any:
    """A process group of `backend` ("gloo" or "nccl") over `store`, outside the default group and registered
    nowhere (threads of one process may each hold one). Every member makes it once, with its rank: the rendezvous
    waits for all of them. `device`: the backend's device here (for NCCL made this thread's CUDA device: a rank's
    update may run in its loop); every wait on it is bounded by `timeout_s` (`broadcast`, `agree_flag`)."""
    if backend == "nccl":  # as torch's own new_group builds one
        use_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s + NCCL_WATCHDOG_SLACK_S)
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))


def close_backend(pg: Any, backend: str, failed: bool) -> None:
    """Shut a group down; after a failed wait an NCCL group is aborted instead (its communicator may hang), before
    NCCL's watchdog would act on its own."""
    if failed and backend == "nccl" and hasattr(pg, "abort"):
        pg.abort()
    else:
        pg.shutdown()


@contextmanager
def update_group(store: Any, rank: int, world: int, backend: str, device: torch.device,
                 timeout_s: float) -> Iterator[Any]:
    """The push's process group of the serving ranks (0..tp-1) and the trainer (rank tp) (`open_backend`), shut
    down when the block ends (also after an error). Every member enters it once per push."""
    pg = open_backend(dist.PrefixStore("push/group", store), rank, world, backend, device, timeout_s)
    failed = False
    try:
        yield pg
    except BaseException:
        failed = True
        raise
    finally:
        close_backend(pg, backend, failed)
        del pg


def bounded_wait(work: Any, timeout_s: float | None) -> None:
    """Wait for a collective's work, at most `timeout_s` (None: the group's own timeout); raises past it."""
    if timeout_s is None:
        work.wait()
    else:
        work.wait(timedelta(seconds=timeout_s))


def broadcast(pg: Any, tensor: torch.Tensor, root: int, timeout_s: float | None = None) -> None:
    """`tensor` from `root` to every member of `pg`. Every member calls it, with a tensor of the same size."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    bounded_wait(pg.broadcast([tensor], opts), timeout_s)


def agree_flag(pg: Any, ok: bool, device: torch.device, timeout_s: float | None = None) -> bool:
    """True when every member of `pg` (trainer included) says ok. Every member calls it; `device` is the
    backend's device on this member (a CUDA tensor for NCCL)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    bounded_wait(pg.allreduce([flag]), timeout_s)
    return int(flag.item()) == 0


def bucket_bytes(bucket: list[list[Any]]) -> int:
    return sum(int(torch.Size(shape).numel()) for _, shape, _ in bucket) * DTYPES[bucket[0][2]].itemsize


def receive_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """The one reusable receive buffer of a push on a rank (the largest bucket's bytes)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def preflight(model: CausalLM, buckets: list[list[list[Any]]], partial: bool = False) -> WeightRefused | None:
    """Why this rank cannot take a push of these buckets (None if it can): names, shapes and dtypes checked
    against the model on meta tensors (all of them, or a subset of its names if `partial`), before a byte moves."""
    try:
        for bucket in buckets:
            if bucket[0][2] not in DTYPES:
                return WeightRefused(f"dtype {bucket[0][2]!r} cannot be pushed", Code.SHAPE_MISMATCH, bucket[0][0])
        pairs = ((name, torch.empty(shape, dtype=DTYPES[dt], device="meta"))
                 for bucket in buckets for name, shape, dt in bucket)
        stage_named(model, pairs, "the push", partial)
    except WeightRefused as e:
        return WeightRefused(str(e).removeprefix("the push: "), e.code, e.tensor)
    except Exception as e:  # posted as this rank's verdict: the others must not wait for it
        return WeightRefused(f"{type(e).__name__}: {e}")
    return None


def receive_buckets(model: CausalLM, pg: Any, buckets: list[list[list[Any]]], root: int, device: torch.device,
                    rank: int = 0, phase: PushPhase | None = None) -> tuple[Staged, WeightRefused | None]:
    """(staged, refusal): every bucket from `root` into one buffer, keeping this rank's slices. A rank that fails on
    a bucket still receives the rest, so every member runs the same broadcasts (while the trainer `send_buckets`).
    `phase` follows the buckets (a broadcast that raises leaves it at its bucket)."""
    buf = receive_buffer(max(bucket_bytes(b) for b in buckets), device)
    staged: Staged = []
    refusal: WeightRefused | None = None
    for i, bucket in enumerate(buckets):
        if phase is not None:
            phase.enter(f"bucket {i + 1}/{len(buckets)}")
        dtype = DTYPES[bucket[0][2]]
        flat = buf[:bucket_bytes(bucket)].view(dtype)
        broadcast(pg, flat, root, None if phase is None else phase.timeout_s)
        if refusal is not None:
            continue
        try:
            faults.hit("push_bucket", rank=rank, bucket=i)
            sizes = [int(torch.Size(shape).numel()) for _, shape, _ in bucket]
            for (name, shape, _), part in zip(bucket, flat.split(sizes)):
                one = stage_one(model, name, part.view(shape), "pushed weights")
                if one is not None:
                    staged.append(one)
        except WeightRefused as e:  # this rank's vote against, after the remaining broadcasts
            refusal = e
        except Exception as e:
            refusal = WeightRefused(f"{type(e).__name__}: {e}")
    return staged, refusal


def stage_pushed(model: CausalLM, rank: int, tp: int, device: torch.device, call: Any) -> Staged:
    """This rank's shard of the trainer's push; the model is not touched. Every serving rank calls it while the
    trainer runs `launch.weight_push.push_weights`; on any problem raises WeightRefused once any group is torn down:
    a wait that raised (a member silent for `call.timeout_s`, or gone) names the phase (worker/push_phase.py)."""
    world, trainer = tp + 1, tp
    phase, store = PushPhase(call.timeout_s), None
    try:
        store = open_store(call.store, world, call.timeout_s)
        trainer_device = store.get(TRAINER_DEVICE_KEY).decode()
        refusal = preflight(model, call.buckets, call.partial)
        mine = {"device": device.type, "backend": push_backend(device.type, trainer_device),
                "error": "" if refusal is None else str(refusal)}
        store.set(verdict_key(rank), json.dumps(mine))
        backend, why = agreed_backend(read_verdicts(store, tp), trainer_device)
        if not backend:
            raise refusal or WeightRefused(f"the push was refused: {why}")
        local = backend_device(backend, device)
        phase.enter("group")
        with update_group(store, rank, world, backend, local, call.timeout_s) as pg:
            staged, refusal = receive_buckets(model, pg, call.buckets, trainer, local, rank, phase)
            phase.enter("agree")
            if not agree_flag(pg, refusal is None, local, call.timeout_s) and refusal is None:
                refusal = WeightRefused("another member of the update group failed during the push")
        if refusal is not None:
            raise refusal
        return staged
    except WeightRefused:
        raise
    except Exception as e:  # a wait that timed out or broke: every member gives up within the timeout
        raise phase.gave_up(e) from None
    finally:
        del store


def send_buckets(store: Any, tp: int, tensors: dict[str, torch.Tensor], groups: list[list[str]],
                 device: torch.device, timeout_s: float, gave_up: Callable[[], bool] = lambda: False) -> bool:
    """The trainer's side of one push (rank tp of the update group), once the update call went out: wait for the
    verdicts, then, if the ranks agreed, broadcast each bucket and agree. True when every member took every bucket;
    False when the push was refused or a rank failed (the cluster's answer says why)."""
    keys, deadline = [verdict_key(r) for r in range(tp)], time.monotonic() + timeout_s
    while not store.check(keys):  # every rank's verdict
        if gave_up():  # the cluster answered already (e.g. refused before dialling the store)
            return False
        if time.monotonic() > deadline:
            raise TimeoutError("the serving ranks did not answer the push within its timeout")
        time.sleep(0.01)
    backend, _ = agreed_backend(read_verdicts(store, tp), device.type)
    if not backend:
        return False
    local = backend_device(backend, device)
    with update_group(store, tp, tp + 1, backend, local, timeout_s) as pg:
        for names in groups:
            flat = torch.cat([tensors[n].detach().reshape(-1).to(local) for n in names])
            broadcast(pg, flat, root=tp)
            del flat
        return agree_flag(pg, True, local)
