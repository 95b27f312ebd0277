"""Lockstep's sharded linears in the places of transformers' `nn.Linear`s, one class per plan style
(worker/generic/tp_plan.py), and the vocab-parallel LM head, for the [1, T, features] inputs transformers' modules
pass: each flattens to [T, features], multiplies through `worker.layers.linear` (the CPU's weight-first and packed
products), and restores the leading dims. Each loads its shard from a checkpoint tensor named as transformers names
the module (`shard_of`, part "")."""

from __future__ import annotations

import torch

from worker.layers import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, Shard, wide_linear


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _unflat(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return y.view(*x.shape[:-1], y.shape[-1])


class ColumnShard(ColumnParallelLinear):
    """`colwise`: this rank's rows [first, first + rows) of the weight; the output stays sharded. With every row
    (first 0, rows = all) it is a replicated linear: the path's stand-in for a linear outside the plan."""

    def __init__(self, in_features: int, rows: int, first: int, total: int, bias: bool, dtype: torch.dtype):
        super().__init__(in_features, {"": (rows, first, total)}, bias, dtype)
        self.rows, self.first, self.total = rows, first, total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _unflat(super().forward(_flat(x)), x)


class GatheredColumn(ColumnShard):
    """`colwise_gather_output` (and `colwise_rep`): column-sharded, then every rank gets the whole output. The
    gather is an all-reduce of each rank's rows placed in zeros (exact: every element has one non-zero term), so it
    takes the device group's one collective path (shared memory on one CPU host, NCCL on GPUs)."""

    def __init__(self, in_features: int, rows: int, first: int, total: int, bias: bool, dtype: torch.dtype,
                 shard: Shard):
        super().__init__(in_features, rows, first, total, bias, dtype)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank of the device group calls it (one all-reduce when TP > 1)."""
        local = super().forward(x)
        if self.shard.size == 1:
            return local
        whole = local.new_zeros(*local.shape[:-1], self.total)
        whole[..., self.first:self.first + self.rows] = local
        return self.shard.all_reduce(whole)


class RowShard(RowParallelLinear):
    """`rowwise`: this rank's input columns; the partial products are all-reduced (the bias added after)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _unflat(super().forward(_flat(x)), x)


class SplitInputRow(RowShard):
    """`rowwise_split_input` (and `rowwise_rep`): the input arrives whole on every rank; each multiplies its own
    columns of it, then the all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = self.shard.rank * self.cols
        return super().forward(x[..., start:start + self.cols])


class FlatLMHead(ParallelLMHead):
    """The vocab-parallel head under transformers' `lm_head` name: this rank's logits shard of [1, N, hidden]."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return _unflat(wide_linear(_flat(hidden), self.weight), hidden)
