"""Device memory: which device a thread works on, and how many KV pages fit beside everything else.

A second manager in the same process must get the cache the first had, not what it left over: every KV cache
this process allocates is entered in `CACHE_LEDGER`, and a new sizing adds back what it holds on that device."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from cluster.config import next_pow2
from worker.graphs import decode_buckets, decode_widths
from worker.step_inputs import StaticBuffers

DEFAULT_MAX_MEMORY_PERCENT = 0.9  # of the memory free for the cache, as transformers' default
ACTIVATION_FACTOR = 8  # hidden-sized tensors live at once at a step's peak (residual, norm, q/k/v, MLP halves ...)
MLP_FACTOR = 3  # gate, up and their product: intermediate-sized tensors at the MLP peak
MiB = 1 << 20


def use_device(device: torch.device | str | None) -> None:
    """Make `device` the calling thread's current CUDA device (a no-op elsewhere): it is per thread, and a thread
    that runs device work without it sends its kernels and NCCL calls to GPU 0."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.set_device(device)


def tensor_bytes(tensors) -> int:
    """Bytes held by these tensors (a meta tensor counts what it would hold)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def static_buffer_bytes(rc: Any) -> int:
    """What the runner's static input buffers for `rc` take: built on the meta device, so nothing is allocated."""
    return tensor_bytes(StaticBuffers(rc, torch.device("meta")).buffers.values())


def hidden_peak_bytes(tokens: int, hidden: int, intermediate_local: int, itemsize: int) -> int:
    """The forward's transient memory at `tokens` tokens (a CUDA graph pool holds about this for the largest bucket)."""
    return tokens * (ACTIVATION_FACTOR * hidden + MLP_FACTOR * intermediate_local) * itemsize


def graph_pool_bytes(buckets: list[int], hidden: int, intermediate_local: int, vocab_local: int, itemsize: int,
                     attention_workspace: int = 0) -> int:
    """What the decode graphs' shared pool holds once every bucket is captured: each bucket's output (its rows'
    logits shard [bucket, vocab_local], alive between replays) plus one transient peak, the largest bucket's
    activations and attention workspace (captures share the pool, so their transients overlap)."""
    if not buckets:
        return 0
    outputs = sum(buckets) * vocab_local * itemsize
    return outputs + hidden_peak_bytes(max(buckets), hidden, intermediate_local, itemsize) + attention_workspace


def activation_peak_bytes(max_batch_tokens: int, hidden: int, intermediate_local: int, vocab: int,
                          max_logit_rows: int, itemsize: int) -> int:
    """The largest step's transient memory: its hidden peak, and the sampled rows' logits and their float32 copy."""
    return hidden_peak_bytes(max_batch_tokens, hidden, intermediate_local, itemsize) + max_logit_rows * vocab * 8


@dataclass(frozen=True)
class MemoryInputs:
    """Everything the sizing needs, as plain numbers (bytes unless said otherwise)."""

    free_bytes: int  # measured free device memory, after the allocator released its cached blocks
    kv_bytes_per_token: int  # this rank's K+V of one token, all layers
    page_size: int  # tokens per page
    static_bytes: int = 0  # the runner's static input buffers
    graph_pool_bytes: int = 0  # CUDA graph pool estimate (0 when graphs are off)
    activation_bytes: int = 0  # the largest step's activation peak
    attention_workspace_bytes: int = 0  # the attention backend's largest workspace
    reclaimable_bytes: int = 0  # this process's earlier KV caches on this device, released before allocating
    max_memory_percent: float | None = None  # share of the free memory the cache side may use (None: 0.9)
    safety_margin: float = 0.0  # share of the budget kept free on top of everything counted
    max_blocks: int | None = None  # never more than every request at full length could use


def plan_kv_blocks(m: MemoryInputs) -> tuple[int, dict[str, int | float]]:
    """(num_blocks, breakdown) for one rank; pure: (free + reclaimable) x max_memory_percent, less every overhead
    and the safety margin, in whole pages. MemoryError naming the numbers when not one page fits."""
    frac = m.max_memory_percent if m.max_memory_percent is not None else DEFAULT_MAX_MEMORY_PERCENT
    if not 0 < frac <= 1:
        raise ValueError(f"max_memory_percent={frac!r}: must be in (0, 1]")
    if not 0 <= m.safety_margin < 1:
        raise ValueError(f"safety_margin={m.safety_margin!r}: must be in [0, 1)")
    available = int((m.free_bytes + m.reclaimable_bytes) * frac)
    after_overhead = available - m.static_bytes - m.graph_pool_bytes - m.activation_bytes - m.attention_workspace_bytes
    margin = int(max(after_overhead, 0) * m.safety_margin)
    budget = after_overhead - margin
    page_bytes = m.kv_bytes_per_token * m.page_size
    blocks = budget // page_bytes if budget > 0 else 0
    breakdown: dict[str, int | float] = {
        "free": m.free_bytes, "reclaimable": m.reclaimable_bytes, "max_memory_percent": frac,
        "available": available, "static": m.static_bytes, "graph_pool": m.graph_pool_bytes,
        "activations": m.activation_bytes, "attention_workspace": m.attention_workspace_bytes,
        "safety_margin": margin, "kv_budget": max(budget, 0), "page_bytes": page_bytes}
    if blocks < 1:
        raise MemoryError("no KV page fits: " + describe(breakdown))
    if m.max_blocks is not None:
        blocks = min(blocks, m.max_blocks)
    breakdown.update(num_blocks=blocks, kv_cache=blocks * page_bytes)
    return blocks, breakdown


def describe(breakdown: dict[str, int | float]) -> str:
    """One line for the manager's notes, sizes in MiB."""
    return "KV sizing: " + " ".join(f"{k}={v}" if isinstance(v, float) or k == "num_blocks" else
                                    f"{k}={v / MiB:.1f}MiB" for k, v in breakdown.items())


def measure_free_bytes(device: torch.device | str) -> tuple[int, int]:
    """(free, total) device memory after the caching allocator gave its unused blocks back (`empty_cache()` acts
    on the current device, so the thread's device is set first). Elsewhere: the host's MemAvailable, MemTotal."""
    device = torch.device(device)
    if device.type == "cuda":
        use_device(device)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    return host_memory()


def host_memory() -> tuple[int, int]:
    """(MemAvailable, MemTotal) from /proc/meminfo, in bytes; (0, 0) where there is no such file."""
    try:
        with open("/proc/meminfo") as f:  # lines "Key:   value kB"
            found = {key: int(rest.split()[0]) * 1024 for key, _, rest in (line.partition(":") for line in f)}
    except (OSError, ValueError, IndexError):
        found = {}
    return found.get("MemAvailable", 0), found.get("MemTotal", 0)


class ReleasedCache:
    """Stands in for the layer list of a KV cache that was handed to a newer manager: any use fails loudly."""

    def __iter__(self):
        raise RuntimeError("this KV cache was released to a newer manager of the same model; make a new manager")

    def __len__(self) -> int:
        return 0


def release_kv(cache: Any) -> None:
    """Drop a KV cache's tensors (a `worker.kv_cache.KVCache`), leaving a stand-in that refuses to be used."""
    cache.k = cache.v = ReleasedCache()


class CacheLedger:
    """The KV caches this process holds, per (device, owner: the model served), weakly. `held` is what a new sizing
    adds back to the measured free memory; `release_all` then releases them so the new cache reuses it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[str, int, int, weakref.ref, Callable[[Any], None]]] = {}

    def hold(self, cache: object, device: torch.device | str, owner: object, nbytes: int,
             release: Callable[[Any], None] = release_kv) -> None:
        key = id(cache)
        with self._lock:
            self._entries[key] = (str(torch.device(device)), id(owner), int(nbytes), weakref.ref(cache), release)
        weakref.finalize(cache, self._forget, key)

    def _forget(self, key: int) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def _mine(self, device: torch.device | str, owner: object) -> dict[int, tuple]:
        dev = str(torch.device(device))
        return {k: e for k, e in self._entries.items() if e[0] == dev and e[1] == id(owner)}

    def held(self, device: torch.device | str, owner: object) -> int:
        with self._lock:
            return sum(e[2] for e in self._mine(device, owner).values())

    def release_all(self, device: torch.device | str, owner: object) -> int:
        """Release every cache `owner` holds on `device` (its managers must be done with them); the bytes freed."""
        with self._lock:
            mine = self._mine(device, owner)
            for k in mine:
                del self._entries[k]
        for _, _, _, ref, release in mine.values():
            cache = ref()
            if cache is not None:
                release(cache)
        return sum(e[2] for e in mine.values())


CACHE_LEDGER = CacheLedger()


def propose_num_blocks(rc: Any, model_config: Any, tp: int, dtype: torch.dtype, device: torch.device | str,
                       kv_bytes_per_token: int, owner: object, *, max_memory_percent: float | None = None,
                       attention_workspace_bytes: int = 0, ledger: CacheLedger = CACHE_LEDGER,
                       measure: Callable[[Any], tuple[int, int]] = measure_free_bytes
                       ) -> tuple[int, dict[str, int | float]]:
    """This rank's proposal for `num_blocks` (the group then takes the MIN with `cluster.dist.agree_min`), and its
    breakdown; `measure` and `ledger` are parameters so tests can feed numbers."""
    itemsize, hidden = dtype.itemsize, model_config.hidden_size
    inter = (getattr(model_config, "intermediate_size", None) or 4 * hidden) // tp  # a generic model may not say
    rows = next_pow2(rc.max_requests_per_batch)
    widths = decode_widths(rc.paged_kernels, rc.max_kv_padded)  # one graph a (bucket, width): an output each
    buckets = [b for b in decode_buckets(rc.max_requests_per_batch) for _ in widths] if rc.use_cuda_graph[1] else []
    return plan_kv_blocks(MemoryInputs(
        free_bytes=measure(device)[0], kv_bytes_per_token=kv_bytes_per_token, page_size=rc.page_size,
        static_bytes=static_buffer_bytes(rc),
        graph_pool_bytes=graph_pool_bytes(buckets, hidden, inter, -(-model_config.vocab_size // tp), itemsize,
                                          attention_workspace_bytes),
        activation_bytes=activation_peak_bytes(rc.max_tokens_padded, hidden, inter, model_config.vocab_size,
                                               rows, itemsize),
        attention_workspace_bytes=attention_workspace_bytes, reclaimable_bytes=ledger.held(device, owner),
        max_memory_percent=max_memory_percent, safety_margin=rc.safety_margin,
        max_blocks=rc.max_requests_per_batch * rc.max_blocks_per_request))
