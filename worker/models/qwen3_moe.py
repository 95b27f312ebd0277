"""Qwen3-MoE: Qwen3's attention (q/k norm) with a softmax top-k router over `num_experts` experts of
`moe_intermediate_size` on the layers `decoder_sparse_step` picks and `mlp_only_layers` does not exclude (those keep
a dense MLP of `intermediate_size`); weights renormalised when `norm_topk_prob`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.experts import ExpertPlacement, Experts
from worker.gated_mlp import GatedMLP
from worker.layers import Shard
from worker.models.llama import DENSE_NAMES
from worker.models.qwen3 import Qwen3
from worker.moe_block import ExpertNames, SparseMoE
from worker.routers import SoftmaxTopK


def placement(num_experts: int, inter: int, shard: Shard, expert_parallel: bool) -> ExpertPlacement:
    return (ExpertPlacement.expert_parallel if expert_parallel else ExpertPlacement.tensor_parallel)(
        num_experts, inter, shard)


class Qwen3Moe(Qwen3):
    model_types = ("qwen3_moe",)
    names = DENSE_NAMES + ExpertNames().table()

    def is_sparse(self, config: Any, layer: int) -> bool:
        return (layer not in (config.mlp_only_layers or []) and config.num_experts > 0
                and (layer + 1) % config.decoder_sparse_step == 0)

    def make_mlp(self, config: Any, shard: Shard, layer: int, dtype: torch.dtype) -> nn.Module:
        if not self.is_sparse(config, layer):
            return GatedMLP(config.hidden_size, config.intermediate_size, False, shard, dtype)
        router = SoftmaxTopK(config.num_experts, config.hidden_size, config.num_experts_per_tok,
                             bool(config.norm_topk_prob), dtype)
        where = placement(config.num_experts, config.moe_intermediate_size, shard, self.expert_parallel)
        return SparseMoE(router, Experts(config.hidden_size, where, dtype), None, shard)
