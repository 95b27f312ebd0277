"""The gated MLP (down(act(gate(x)) * up(x)), act SiLU or Gemma's tanh GELU), its intermediate dim split across
ranks: the dense layers' feed-forward, and a MoE family's shared experts (one all-reduce, in the down projection)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from cluster.errors import UnsupportedModel
from worker.checkpoint_names import NameRule, NameTable
from worker.layers import ColumnParallelLinear, RowParallelLinear, Shard


# transformers' activation names (ACT2FN) this block computes, as transformers computes them
ACTIVATIONS = {"silu": nn.functional.silu,
               "gelu_pytorch_tanh": functools.partial(nn.functional.gelu, approximate="tanh")}


def activation(name: str):
    """The activation transformers calls `name`, or UnsupportedModel naming it."""
    if name not in ACTIVATIONS:
        raise UnsupportedModel(f"activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool, shard: Shard, dtype: torch.dtype, reduce: bool = True,
                 act: str = "silu"):
        super().__init__()
        self.act = activation(act)
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
        return self.down_proj(self.act(gate).mul_(up))


def mlp_names(block: str) -> NameTable:
    """The rules of a gated MLP at `model.layers.{L}.<block>` (e.g. "mlp", "mlp.shared_experts")."""
    module = "layers.{L}." + block
    return NameTable((
        NameRule(f"model.layers.{{L}}.{block}.gate_proj.{{kind}}", f"{module}.gate_up_proj", "gate"),
        NameRule(f"model.layers.{{L}}.{block}.up_proj.{{kind}}", f"{module}.gate_up_proj", "up"),
        NameRule(f"model.layers.{{L}}.{block}.down_proj.{{kind}}", f"{module}.down_proj"),
    ))
