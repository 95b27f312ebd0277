"""The gated SiLU MLP (down(silu(gate(x)) * up(x))), its intermediate dim split across ranks: the dense layers'
feed-forward, and a MoE family's shared experts (one all-reduce, in the down projection)."""

from __future__ import annotations

import torch
from torch import nn

from cluster.errors import UnsupportedModel
from worker.checkpoint_names import NameRule, NameTable
from worker.layers import ColumnParallelLinear, RowParallelLinear, Shard


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool, shard: Shard, dtype: torch.dtype, reduce: bool = True):
        super().__init__()
        if inter % shard.size:
            raise UnsupportedModel(f"intermediate size {inter} does not split over tp={shard.size} ranks")
        self.rows = rows = inter // shard.size
        self.gate_up_proj = ColumnParallelLinear(hidden, {
            "gate": (rows, shard.rank * rows, inter), "up": (rows, shard.rank * rows, inter)}, bias=bias, dtype=dtype)
        # reduce=False: the caller sums this rank's partial output with others' before one all-reduce
        self.down_proj = RowParallelLinear(inter, hidden, bias, shard, dtype, reduce=reduce)

    def forward(self, x: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H]; `real` (the step's real-token mask) is not needed by a dense block."""
        gate, up = self.gate_up_proj(x).split([self.rows, self.rows], dim=-1)
        return self.down_proj(nn.functional.silu(gate).mul_(up))


def mlp_names(block: str) -> NameTable:
    """The rules of a gated MLP at `model.layers.{L}.<block>` (e.g. "mlp", "mlp.shared_experts")."""
    module = "layers.{L}." + block
    return NameTable((
        NameRule(f"model.layers.{{L}}.{block}.gate_proj.{{kind}}", f"{module}.gate_up_proj", "gate"),
        NameRule(f"model.layers.{{L}}.{block}.up_proj.{{kind}}", f"{module}.gate_up_proj", "up"),
        NameRule(f"model.layers.{{L}}.{block}.down_proj.{{kind}}", f"{module}.down_proj"),
    ))
