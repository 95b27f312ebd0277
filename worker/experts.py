"""Routed experts (gated SiLU MLPs), placed across ranks one of two ways (`ExpertPlacement`):

- tensor-parallel (the default): every rank holds every expert, a slice of its intermediate dim;
- expert-parallel: every rank holds E / tp whole experts.

Either way every rank holds the whole token batch (the attention's all-reduce left it replicated) and the same
routing (the router is replicated), so the tokens an expert needs are already on the rank that holds it; each
rank computes its experts' part of the output, and the MoE block's one all-reduce sums the parts and brings every
token's result to every rank (worker/moe_block.py). So the block has the collectives of a dense MLP.

Compute: the (token, choice) pairs are sorted by expert and counted on the device (`sort_by_expert`). On CUDA the
grouped Triton kernel (worker/triton_experts.py) runs each local expert over its rows from those device-side
counts, with no host sync, so eagerly, in a decode graph and in a compiled forward alike. Elsewhere each expert that
has tokens runs one product over its rows (the counts read on the host) and the results are weighted and summed
into their tokens in expert order (as transformers' loop adds them); inside a compiled forward on the CPU every
local expert runs over every token with its routing weight masked instead (static shapes).

A family whose experts compute otherwise (gpt-oss: biases, clamped SwiGLU, transformers' transposed layout;
worker/clamped_experts.py) subclasses `Experts`: its weights (`make_weights`), one expert's product (`expert`),
the CUDA kernel's arguments (`grouped_kernel`) and its checkpoint parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cluster.errors import UnsupportedModel
from worker.layers import Shard, expect_shape
from worker.packed_linear import packed_product


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts, and which intermediate rows of each, this rank holds."""

    num_experts: int
    inter: int  # each expert's intermediate size
    first: int  # the first expert held here
    count: int  # experts held here
    inter_start: int  # the first intermediate row held here
    inter_rows: int  # intermediate rows held here

    @classmethod
    def tensor_parallel(cls, num_experts: int, inter: int, shard: Shard) -> ExpertPlacement:
        if inter % shard.size:
            raise UnsupportedModel(f"moe intermediate size {inter} does not split over tp={shard.size} ranks")
        rows = inter // shard.size
        return cls(num_experts, inter, 0, num_experts, shard.rank * rows, rows)

    @classmethod
    def expert_parallel(cls, num_experts: int, inter: int, shard: Shard) -> ExpertPlacement:
        if num_experts % shard.size:
            raise UnsupportedModel(f"{num_experts} experts do not split over tp={shard.size} ranks "
                                   f"(expert parallelism)")
        count = num_experts // shard.size
        return cls(num_experts, inter, shard.rank * count, count, 0, inter)

    def holds(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count


def sort_by_expert(experts: torch.Tensor, placement: ExpertPlacement) -> tuple[torch.Tensor, torch.Tensor,
                                                                            torch.Tensor]:
    """(order, offsets, counts), on the device, no host sync: the (token, choice) pair indexes of `experts` [T, k]
    sorted by local expert, stable (pairs of other ranks' experts last); each local expert's first sorted position
    and its number of pairs [count]."""
    local = experts.reshape(-1) - placement.first
    local = torch.where((local >= 0) & (local < placement.count), local, placement.count)
    order = torch.argsort(local, stable=True)
    counts = torch.zeros(placement.count + 1, dtype=torch.int64, device=experts.device)
    counts = counts.scatter_add_(0, local, torch.ones_like(local))[:placement.count]
    return order, torch.cumsum(counts, 0) - counts, counts


def expert_product(x: torch.Tensor, stacked: torch.Tensor, e: int) -> torch.Tensor:
    """x stacked[e]^T: through expert e's packed weight on the CPU (worker/packed_linear.py), else F.linear."""
    y = packed_product(x, stacked, index=e)
    return nn.functional.linear(x, stacked[e]) if y is None else y


def _silu_gated(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, e: int) -> torch.Tensor:
    gate, up = expert_product(x, gate_up, e).chunk(2, dim=-1)
    return expert_product(nn.functional.silu(gate) * up, down, e)


class Experts(nn.Module):
    """This rank's experts: `gate_up` [count, 2 * rows, H] (gate rows, then up rows) and `down` [count, H, rows].
    `forward` returns this rank's part of the output (not reduced)."""

    def __init__(self, hidden: int, placement: ExpertPlacement, dtype: torch.dtype):
        super().__init__()
        self.placement = placement
        self.hidden = hidden
        self.make_weights(dtype)

    def make_weights(self, dtype: torch.dtype) -> None:
        p, h = self.placement, self.hidden
        self.gate_up = nn.Parameter(torch.empty(p.count, 2 * p.inter_rows, h, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(p.count, h, p.inter_rows, dtype=dtype), requires_grad=False)

    def expert(self, xs: torch.Tensor, e: int) -> torch.Tensor:
        """Local expert `e`'s output for its rows `xs` [n, H] (this rank's part of it), unweighted."""
        return _silu_gated(xs, self.gate_up, self.down, e)

    def grouped_kernel(self) -> dict[str, Any]:
        """`grouped_experts`' weight arguments (worker/triton_experts.py) for this layout and activation."""
        return {"gate_up": self.gate_up, "down": self.down}

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; experts, weights [T, k]: each token's chosen experts and their weights."""
        if x.is_cuda:
            from worker.triton_experts import grouped_experts  # Triton is needed on this path only

            order, offsets, counts = sort_by_expert(experts, self.placement)
            return grouped_experts(x, order=order, offsets=offsets, counts=counts, weights=weights,
                                   **self.grouped_kernel())
        if torch.compiler.is_compiling():
            return self._masked(x, experts, weights)
        return self._grouped(x, experts, weights)

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        order, _, counted = sort_by_expert(experts, self.placement)
        counts = counted.tolist()
        order = order[:sum(counts)]
        tokens = torch.div(order, experts.shape[1], rounding_mode="floor")
        xs = x.index_select(0, tokens)
        ys, at = [], 0
        for e, n in enumerate(counts):
            if n:
                ys.append(self.expert(xs[at:at + n], e))
            at += n
        out = torch.zeros_like(x)
        if ys:
            y = torch.cat(ys) * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(x.dtype)
            out.index_add_(0, tokens, y)
        return out

    def _masked(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        p = self.placement
        out = torch.zeros_like(x)
        for e in range(p.count):
            w = (weights * (experts == p.first + e)).sum(-1, keepdim=True).to(x.dtype)
            out = out + self.expert(x, e) * w
        return out

    # -- checkpoint parts: "gate.E", "up.E", "down.E" (published, one tensor per expert); "gate_up", "down"
    # (transformers' fused [E, 2I, H] and [E, H, I]) --

    def checkpoint_parts(self) -> list[tuple[str, str]]:
        return [(f"{w}.{e}", "weight") for e in range(self.placement.num_experts) for w in ("gate", "up", "down")]

    def covered_parts(self, part: str) -> list[str]:
        names = ("gate", "up") if part == "gate_up" else ("down",)
        return [f"{w}.{e}" for e in range(self.placement.num_experts) for w in names]

    def view(self, part: str, kind: str) -> torch.Tensor:
        """This rank's rows (gate, up) or columns (down) of one expert; empty for an expert held elsewhere."""
        p = self.placement
        name, expert = part.split(".")
        e = int(expert)
        if not p.holds(e):
            return self.gate_up.data[0, :0] if name != "down" else self.down.data[0, :, :0]
        if name == "down":
            return self.down.data[e - p.first]
        start = 0 if name == "gate" else p.inter_rows
        return self.gate_up.data[e - p.first, start:start + p.inter_rows]

    def shard_of(self, part: str, kind: str, src: Any) -> tuple[torch.Tensor, torch.Tensor]:
        p, h = self.placement, self.hidden
        rows = slice(p.inter_start, p.inter_start + p.inter_rows)
        held = slice(p.first, p.first + p.count)
        if part == "gate_up":  # gate rows then up rows: both sides as [count, 2, rows, H], views (no copy staged)
            expect_shape(src, (p.num_experts, 2 * p.inter, h))
            dst = self.gate_up.data.view(p.count, 2, p.inter_rows, h)
            return dst, src[held].reshape(p.count, 2, p.inter, h)[:, :, rows]
        if part == "down":
            expect_shape(src, (p.num_experts, h, p.inter))
            return self.down.data, src[held, :, rows]
        name, expert = part.split(".")
        expect_shape(src, (h, p.inter) if name == "down" else (p.inter, h))
        dst = self.view(part, kind)
        if not p.holds(int(expert)):
            return dst, src[:, :0] if name == "down" else src[:0]
        return dst, src[:, rows] if name == "down" else src[rows]
