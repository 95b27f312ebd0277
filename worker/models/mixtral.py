"""Mixtral: Mistral's attention (every layer windowed when `sliding_window` is set) and on every layer
`num_local_experts` experts under a softmax top-k router whose weights are always renormalised. Published
checkpoints name the block `block_sparse_moe` and the projections w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.experts import Experts
from worker.layers import Shard
from worker.models.decoder import BASE_NAMES
from worker.models.llama import Mistral
from worker.models.qwen3_moe import placement
from worker.moe_block import ExpertNames, SparseMoE
from worker.routers import SoftmaxTopK
from worker.self_attention import ATTENTION_NAMES


class Mixtral(Mistral):
    model_types = ("mixtral",)
    names = BASE_NAMES + ATTENTION_NAMES + ExpertNames(block="block_sparse_moe", gate="w1", up="w3",
                                                       down="w2").table()

    def make_mlp(self, config: Any, shard: Shard, layer: int, dtype: torch.dtype) -> nn.Module:
        router = SoftmaxTopK(config.num_local_experts, config.hidden_size, config.num_experts_per_tok, True, dtype)
        where = placement(config.num_local_experts, config.intermediate_size, shard, self.expert_parallel)
        return SparseMoE(router, Experts(config.hidden_size, where, dtype), None, shard)
