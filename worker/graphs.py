"""CUDA graphs for the decode step: batch buckets, capture, replay, and the address check (docs/architecture.md,
"The runner"). TP's NCCL all-reduces are captured with the forward, so every rank must capture the same buckets in
the same order and replay in lockstep: the runner does both from the plans. `EagerStandIn` is the CPU tests' graph.
A graph reads fixed addresses; `changed_addresses` names any that moved since capture (a weight update must copy in
place, never rebind)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cluster.config import next_pow2


class GraphInputMoved(RuntimeError):
    """A replay's static input is not where the graph was captured reading it."""


def decode_buckets(max_requests_per_batch: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4 ... up to the power of two a full batch pads to."""
    return [1 << i for i in range(next_pow2(max_requests_per_batch).bit_length())]


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `num_seqs` sequences; None (run eagerly) when none does."""
    return next((b for b in buckets if b >= num_seqs), None) if num_seqs > 0 else None


GATHER_WIDTH = 256  # the narrowest KV width a gathering decode graph is laid out at


def decode_widths(paged_kernels: bool, max_kv_padded: int) -> list[int]:
    """The KV widths decode graphs are laid out at: none to speak of (0) where the paged kernels read block tables;
    for the paged SDPA gather 256 x 2^k up to max_kv_padded, so a replay gathers the narrowest that holds its keys."""
    if paged_kernels:
        return [0]
    widths, w = [], GATHER_WIDTH
    while w < max_kv_padded:
        widths, w = widths + [w], w * 2
    return widths + [max_kv_padded]


GraphKey = tuple[int, int]  # (batch bucket, KV width) of one captured decode graph


@dataclass
class Captured:
    replay: Callable[[], None]
    output: torch.Tensor  # the captured forward's output; every replay rewrites it in place
    handle: Any = None  # keeps the graph object alive


class CudaGraphFactory:
    """torch.cuda.CUDAGraph captures sharing one memory pool, warmed up and captured on one side stream."""

    def __init__(self, device: torch.device):
        self.device, self.pool = device, torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device=device)

    def capture(self, fn: Callable[[], torch.Tensor], static_inputs: dict[str, torch.Tensor]) -> Captured:
        """Every rank of the device group calls it, for the same buckets in the same order (fn all-reduces)."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            fn()  # warm-up on the capture stream: lazy library handles and workspaces are made outside capture
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()
        torch.cuda.synchronize(self.device)
        return Captured(replay=graph.replay, output=out, handle=graph)


class EagerStandIn:
    """The CPU stand-in for a graph: replay re-runs the eager function into the captured output's storage."""

    def __init__(self) -> None:
        self.recorded: list[dict[str, int]] = []  # static inputs' addresses of each capture, in capture order

    def capture(self, fn: Callable[[], torch.Tensor], static_inputs: dict[str, torch.Tensor]) -> Captured:
        self.recorded.append({k: t.data_ptr() for k, t in static_inputs.items()})
        out = fn()
        return Captured(replay=lambda: out.copy_(fn()), output=out)


GraphFactory = CudaGraphFactory | EagerStandIn  # what captures a bucket's graph: `capture(fn, static_inputs)`


def tensor_addresses(model: torch.nn.Module, extra: dict[str, torch.Tensor]) -> dict[str, int]:
    """name -> data_ptr of every parameter and buffer of `model` and of each tensor in `extra`."""
    return {name: t.data_ptr() for name, t in [*model.named_parameters(), *model.named_buffers(), *extra.items()]}


class DecodeGraphs:
    """The decode graphs of one runner, one per (batch bucket, KV width): capture up to a batch cap, the graph a step
    takes (`key_for`), replay, counters. A runner lives across managers (driver/api/model.py), so a later, larger
    cap captures only the buckets it adds."""

    def __init__(self, buckets: list[int], factory: GraphFactory, widths: list[int] = (0,)):
        self.buckets, self.widths, self.factory = sorted(buckets), sorted(widths), factory
        self.graphs: dict[GraphKey, Captured] = {}
        self.static: dict[GraphKey, dict[str, tuple[int, tuple[int, ...]]]] = {}
        self.addresses: dict[str, int] = {}
        # captures: graphs captured in this runner's life; pool_bytes: device memory the captures took (CUDA)
        self.stats: dict[str, Any] = {"captured_buckets": [], "kv_widths": [], "replays": 0, "eager_steps": 0,
                                      "captures": 0, "pool_bytes": 0, "output_bytes": 0}

    def missing(self, cap: int) -> list[GraphKey]:
        """The graphs a batch of up to `cap` sequences could take that are not captured yet."""
        top = bucket_for(min(cap, self.buckets[-1]), self.buckets)
        return [(b, w) for b in self.buckets for w in self.widths
                if top is not None and b <= top and (b, w) not in self.graphs]

    def key_for(self, num_seqs: int, kv_width: int) -> GraphKey | None:
        """The captured graph of the fewest rows, then the narrowest width, that holds the step; None: eager."""
        fits = [k for k in self.graphs if k[0] >= num_seqs > 0 and k[1] >= kv_width]
        return min(fits, default=None)

    def capture_all(self, prepare: Callable[[GraphKey], tuple[Callable[[], torch.Tensor], dict[str, torch.Tensor]]],
                    reads: Callable[[], dict[str, int]], cap: int | None = None) -> None:
        """Capture every graph up to the bucket holding `cap` sequences (None: all) not captured yet, largest first
        (smaller ones reuse the shared pool), then snapshot the addresses the graphs read. Every rank of the device
        group calls it with the same cap (the forward all-reduces)."""
        todo = self.missing(self.buckets[-1] if cap is None else cap)
        cuda = isinstance(self.factory, CudaGraphFactory)
        before = torch.cuda.memory_reserved(self.factory.device) if cuda and todo else 0
        for key in sorted(todo, reverse=True):
            fn, static = prepare(key)
            self.graphs[key] = graph = self.factory.capture(fn, static)
            self.static[key] = {k: (t.data_ptr(), tuple(t.shape)) for k, t in static.items()}
            self.stats["captures"] += 1
            self.stats["output_bytes"] += graph.output.numel() * graph.output.element_size()
        if cuda and todo:
            self.stats["pool_bytes"] += torch.cuda.memory_reserved(self.factory.device) - before
        self.addresses = reads()
        self.stats["captured_buckets"] = sorted({b for b, _ in self.graphs})
        self.stats["kv_widths"] = sorted({w for _, w in self.graphs})

    def replay(self, key: GraphKey, static: dict[str, torch.Tensor]) -> torch.Tensor:
        """Replay graph `key` on the static inputs the step was laid out in; returns its output.
        Every rank of the device group calls it (the graph all-reduces)."""
        want = self.static[key]
        moved = sorted(k for k, t in static.items() if (t.data_ptr(), tuple(t.shape)) != want.get(k))
        if moved:
            raise GraphInputMoved(f"decode graph {key}: static inputs {moved} are not where the graph reads")
        graph = self.graphs[key]
        graph.replay()
        self.stats["replays"] += 1
        return graph.output

    def drop_all(self) -> None:
        """Forget every captured graph (their memory pool goes with them on CUDA) and the address snapshot: memory
        they read is being released (docs/weights.md, "Releasing memory"), so the next step re-captures every
        bucket it needs. Every rank of the device group calls it at the same boundary (captures all-reduce)."""
        self.graphs.clear()
        self.static.clear()
        self.addresses = {}
        if isinstance(self.factory, CudaGraphFactory):
            self.factory.pool = torch.cuda.graph_pool_handle()  # the old pool is freed with its last graph
        self.stats["captured_buckets"], self.stats["kv_widths"] = [], []
        self.stats["drops"] = self.stats.get("drops", 0) + 1

    def changed_addresses(self, now: dict[str, int]) -> list[str]:
        """Names whose address differs from the snapshot at capture (or that vanished); none before capture."""
        return sorted(k for k, ptr in self.addresses.items() if now.get(k) != ptr)
