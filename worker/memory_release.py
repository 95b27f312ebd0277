"""Releasing one rank's device memory between rollouts and taking it back (docs/weights.md, "Releasing memory").

A tag's tensors keep their Python objects, shapes and views; only their storage is resized to nothing (as FSDP
frees a flat parameter), so every module, view and tied weight still points at the same storage when it is
resized back. The new allocation may lie elsewhere, so the decode graphs are dropped at release and re-captured
by the next step (`DecodeGraphs.drop_all`), which snapshots the addresses the weight-update check compares with.
Every rank runs `run_memory_call` at the same boundary: a local check, a vote, the work, a second vote, then every
rank's memory figures gathered."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import torch

from cluster.dist import Groups, agree_figures
from cluster.errors import Code
from cluster.protocol import MEMORY_TAGS
from worker.packed_linear import forget_packed
from worker.runner import ModelRunner
from worker.votes import refusals

TAGS = MEMORY_TAGS  # the wire's names for what a call may release
KV_CACHE, WEIGHTS = TAGS
FIGURES = ("rank", "before", "after", "kv_cache_bytes", "weights_bytes", "host_bytes")  # one gathered row a rank


@dataclass
class MemoryCall:
    """What every rank must do, as plain data (it travels in a CALL plan as msgpack)."""

    action: str  # "release" | "resume"
    tags: list[str] = field(default_factory=lambda: list(TAGS))
    keep_weights_on_host: bool = True  # release: copy the weights to host memory first (vLLM's sleep level 1)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def check_call(call: MemoryCall) -> None:
    """ValueError naming what is wrong with a call's action or tags (before anything is queued or sent)."""
    if call.action not in ("release", "resume"):
        raise ValueError(f"action={call.action!r}: must be 'release' or 'resume'")
    unknown = [t for t in call.tags if t not in TAGS]
    if unknown or not call.tags:
        raise ValueError(f"tags={call.tags!r}: each must be one of {TAGS}, at least one")


def resident_bytes(device: torch.device) -> int:
    """The memory figure of this rank: on CUDA the device's used memory (total - free, what `nvidia-smi` shows),
    elsewhere this process's resident set (VmRSS), where freed host memory shows only once returned to the OS."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return int(total - free)
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return 0


def give_back_freed(device: torch.device) -> None:
    """Hand freed memory back: the caching allocator's blocks on CUDA, glibc's free pages (malloc_trim) elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return
    libc = ctypes.CDLL(None)  # this process's own symbols, libc's among them (find_library would run ldconfig)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage` (copies bytes whatever the tensors' dtypes)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class Released:
    """One storage that was resized to nothing: its size, and its bytes on the host when they were kept."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None

    def allocate(self) -> None:
        """Give the storage its bytes back (uninitialised; a no-op when it has them)."""
        if self.storage.nbytes() != self.nbytes:
            self.storage.resize_(self.nbytes)


def storages(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under `tensors` (a tied weight or a fused parameter's views count once)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen.setdefault(s.data_ptr(), s)
    return list(seen.values())


class RankMemory:
    """What one rank has released, and how to take it back. Changed only by `run_memory_call` (every rank at once)
    and by weight updates (`before_update`, `after_update`), so every rank holds the same state."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.kv: list[Released] | None = None
        self.weights: list[Released] | None = None
        self.weights_written = False  # a full weight update filled the weights since they were released

    @property
    def released(self) -> list[str]:
        return [t for t, held in ((KV_CACHE, self.kv), (WEIGHTS, self.weights)) if held is not None]

    def refusal(self, call: MemoryCall) -> tuple[str, str] | None:
        """(code, message) when this rank cannot do `call`; None when it can. Local; the caller votes."""
        if (call.action == "resume" and WEIGHTS in call.tags and self.weights is not None
                and not self.weights_written and any(r.host is None for r in self.weights)):
            return (Code.WEIGHTS_NOT_RESTORED, "the weights were released without a host copy and no full weight "
                                               "update has filled them since: update_weights before resume_memory")
        return None

    @torch.no_grad()
    def release(self, call: MemoryCall) -> dict[str, int]:
        """Free what `call.tags` name (already released tags are left as they are); bytes released by tag."""
        freed = {KV_CACHE: 0, WEIGHTS: 0}
        graphs = self.runner.graphs
        if graphs is not None and any(t not in self.released for t in call.tags):
            graphs.drop_all()
        if KV_CACHE in call.tags and self.kv is None:
            self.kv = [Released(s, s.nbytes()) for s in storages(self.runner.cache.tensors())]
            freed[KV_CACHE] = self._free(self.kv)
        if WEIGHTS in call.tags and self.weights is None:
            model = self.runner.model
            forget_packed(model)  # the weights' packed copies for decode products go with them
            self.weights = [Released(s, s.nbytes()) for s in storages(list(model.parameters()))]
            if call.keep_weights_on_host:
                pin = self.runner.device.type == "cuda"
                for r in self.weights:
                    r.host = torch.empty(r.nbytes, dtype=torch.uint8, pin_memory=pin)
                    r.host.copy_(byte_view(r.storage))
            self.weights_written = False
            freed[WEIGHTS] = self._free(self.weights)
        give_back_freed(self.runner.device)
        return freed

    @staticmethod
    def _free(released: list[Released]) -> int:
        for r in released:
            r.storage.resize_(0)
        return sum(r.nbytes for r in released)

    @torch.no_grad()
    def resume(self, call: MemoryCall) -> dict[str, int]:
        """Take back what `call.tags` name: the KV cache zeroed, the weights from the host copy (or as the update
        since wrote them). Idempotent per storage, so a resume that failed on some rank can simply be retried."""
        restored = {KV_CACHE: 0, WEIGHTS: 0}
        if KV_CACHE in call.tags and self.kv is not None:
            for r in self.kv:
                r.allocate()
                byte_view(r.storage).zero_()
            restored[KV_CACHE] = sum(r.nbytes for r in self.kv)
        if WEIGHTS in call.tags and self.weights is not None:
            for r in self.weights:
                r.allocate()
                if r.host is not None and not self.weights_written:
                    byte_view(r.storage).copy_(r.host)
            restored[WEIGHTS] = sum(r.nbytes for r in self.weights)
        return restored

    def forget(self, call: MemoryCall) -> None:
        """Every rank resumed `call.tags`: drop the records (and the host copies)."""
        if KV_CACHE in call.tags:
            self.kv = None
        if WEIGHTS in call.tags:
            self.weights, self.weights_written = None, False

    def before_update(self) -> None:
        """A weight update is about to stage and copy into the weights: released ones get their storage back.
        Every rank calls it before `run_update`."""
        for r in self.weights or ():
            r.allocate()

    def after_update(self, ok: bool, partial: bool) -> None:
        """A weight update ended on every rank; a full one that applied leaves the weights whole (the host copy is
        then stale and never copied back)."""
        if ok and not partial and self.weights is not None:
            self.weights_written = True
            for r in self.weights:
                r.host = None

    def host_bytes(self) -> int:
        return sum(r.nbytes for r in self.weights or () if r.host is not None)


def run_memory_call(memory: RankMemory, groups: Groups, call: MemoryCall) -> dict[str, Any]:
    """Do `call` on this rank, all ranks or none. Every rank of the control group calls it at the same boundary
    (the loops after a CALL plan, or every caller inside a pause): check, vote, act, vote again, gather figures.
    Returns {"ok": True, "action", "tags", "released", "ranks": [figures of each rank]}, or, refused on some rank
    (nothing changed anywhere), {"ok": False, "code", "error", "rank"}; a failure while acting gives
    {"ok": False, "code": "memory_restore_failed", ...} with what was released still recorded as released."""
    check_call(call)
    refused_here = memory.refusal(call)
    votes = refusals(refused_here is None, refused_here[1] if refused_here else "", groups)
    if votes:
        code = refused_here[0] if refused_here else Code.WEIGHTS_NOT_RESTORED  # every rank's state is the same
        return {"ok": False, "code": code, "rank": votes[0][0],
                "error": "; ".join(f"rank {r}: {m}" for r, m in votes)}
    device = memory.runner.device
    before, error, moved = resident_bytes(device), "", {KV_CACHE: 0, WEIGHTS: 0}
    try:
        moved = memory.release(call) if call.action == "release" else memory.resume(call)
    except Exception as e:  # out of memory on resume, most likely: every rank hears of it below
        error = f"{type(e).__name__}: {e}"
    failed = refusals(not error, error, groups)
    if failed:
        return {"ok": False, "code": Code.MEMORY_RESTORE_FAILED, "rank": failed[0][0],
                "error": "; ".join(f"rank {r}: {m}" for r, m in failed), "released": memory.released}
    if call.action == "resume":
        memory.forget(call)
        give_back_freed(device)  # host copies dropped
    rows = agree_figures([groups.rank, before, resident_bytes(device), moved[KV_CACHE], moved[WEIGHTS],
                          memory.host_bytes()], groups)
    ranks = [dict(zip(FIGURES, row)) | {"freed": row[1] - row[2]} for row in rows]
    return {"ok": True, "action": call.action, "tags": list(call.tags), "released": memory.released,
            "ranks": ranks}
