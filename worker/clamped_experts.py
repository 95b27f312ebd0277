"""gpt-oss's routed experts: transformers' `GptOssExperts` on Lockstep's placements (worker/experts.py). Each expert
has biases and a clamped SwiGLU: gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e], its even columns the gate
and its odd columns the up projection; g = min(gate, limit), u = clamp(up, -limit, limit); h = (u + 1) * g *
sigmoid(alpha * g); out = h @ down_proj[e] + down_proj_bias[e].

The weights stay in transformers' layout ([E, H, 2I] interleaved, [E, I, H]; its checkpoint names, unconverted):
a gate/up pair of columns is adjacent, so a tensor-parallel rank's slice of the intermediate dim is one run of
columns, [2 * start, 2 * (start + rows)), and the CUDA kernel reads the layout through strides
(worker/triton_experts.py). Under tensor parallelism the ranks' partial down products are summed by the block's
all-reduce, so the down bias is added by the rank that holds the first intermediate rows only; under expert
parallelism every rank holds whole experts and adds its own."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.experts import ExpertPlacement, Experts
from worker.layers import expect_shape

PARTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")  # also the checkpoint's names


class ClampedExperts(Experts):
    """This rank's experts: `gate_up` [count, H, 2 * rows] (gate and up columns interleaved), `gate_up_bias`
    [count, 2 * rows], `down` [count, rows, H], `down_bias` [count, H]."""

    def __init__(self, hidden: int, placement: ExpertPlacement, limit: float, alpha: float, dtype: torch.dtype):
        super().__init__(hidden, placement, dtype)
        self.limit, self.alpha = float(limit), float(alpha)
        self.adds_down_bias = placement.inter_start == 0  # see the module's docstring

    def make_weights(self, dtype: torch.dtype) -> None:
        p, h = self.placement, self.hidden

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(p.count, *shape, dtype=dtype), requires_grad=False)

        self.gate_up, self.gate_up_bias = param(h, 2 * p.inter_rows), param(2 * p.inter_rows)
        self.down, self.down_bias = param(p.inter_rows, h), param(h)

    def expert(self, xs: torch.Tensor, e: int) -> torch.Tensor:
        gate_up = xs @ self.gate_up[e] + self.gate_up_bias[e]  # transformers' order: product, then bias
        gate = gate_up[..., ::2].clamp(min=None, max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        out = ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ self.down[e]
        return out + self.down_bias[e] if self.adds_down_bias else out

    def grouped_kernel(self) -> dict[str, Any]:
        return {"gate_up": self.gate_up, "down": self.down, "transposed": True, "gate_up_bias": self.gate_up_bias,
                "down_bias": self.down_bias if self.adds_down_bias else None, "clamp": (self.limit, self.alpha)}

    # -- checkpoint parts: transformers' four tensors, whole experts' rows or columns of this rank --

    def checkpoint_parts(self) -> list[tuple[str, str]]:
        return [(part, "weight") for part in PARTS]

    def covered_parts(self, part: str) -> list[str]:
        return [part]

    def view(self, part: str, kind: str) -> torch.Tensor:
        return {"gate_up_proj": self.gate_up, "gate_up_proj_bias": self.gate_up_bias, "down_proj": self.down,
                "down_proj_bias": self.down_bias}[part].data

    def shard_of(self, part: str, kind: str, src: Any) -> tuple[torch.Tensor, torch.Tensor]:
        p, h = self.placement, self.hidden
        held = slice(p.first, p.first + p.count)
        cols = slice(2 * p.inter_start, 2 * (p.inter_start + p.inter_rows))  # this rank's gate/up pairs
        rows = slice(p.inter_start, p.inter_start + p.inter_rows)
        full, cut = {"gate_up_proj": ((p.num_experts, h, 2 * p.inter), (held, slice(None), cols)),
                     "gate_up_proj_bias": ((p.num_experts, 2 * p.inter), (held, cols)),
                     "down_proj": ((p.num_experts, p.inter, h), (held, rows)),
                     "down_proj_bias": ((p.num_experts, h), (held,))}[part]
        expect_shape(src, full)
        return self.view(part, kind), src[cut]
