"""GLM-4.5 (glm4_moe): GQA attention with biases on q, k, v as `attention_bias` says, q/k norm when `use_qk_norm`,
partial rotary (`partial_rotary_factor` of each head's columns rotate); the first `first_k_dense_replace` layers
keep a dense MLP, the rest route through DeepSeek-V3's group-limited sigmoid router (worker/routers.py) to
`n_routed_experts` experts and add `n_shared_experts` shared experts (one gated MLP of that many times
`moe_intermediate_size`), all under the block's one all-reduce."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.experts import Experts
from worker.gated_mlp import GatedMLP
from worker.layers import Shard
from worker.models.llama import DENSE_NAMES, Llama
from worker.models.qwen3_moe import placement
from worker.moe_block import ExpertNames, SparseMoE
from worker.routers import GroupLimitedSigmoid
from worker.self_attention import AttentionOptions


class Glm4Moe(Llama):
    model_types = ("glm4_moe",)
    names = DENSE_NAMES + ExpertNames(shared="shared_experts", correction=True).table()

    def attention_options(self, config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(config.attention_bias), qk_norm=bool(config.use_qk_norm))

    def make_mlp(self, config: Any, shard: Shard, layer: int, dtype: torch.dtype) -> nn.Module:
        h = config.hidden_size
        if layer < config.first_k_dense_replace:
            return GatedMLP(h, config.intermediate_size, False, shard, dtype)
        router = GroupLimitedSigmoid(config.n_routed_experts, h, config.num_experts_per_tok, config.n_group,
                                     config.topk_group, bool(config.norm_topk_prob),
                                     float(config.routed_scaling_factor), dtype)
        experts = Experts(h, placement(config.n_routed_experts, config.moe_intermediate_size, shard,
                                       self.expert_parallel), dtype)
        shared = GatedMLP(h, config.moe_intermediate_size * config.n_shared_experts, False, shard, dtype,
                          reduce=False) if config.n_shared_experts else None
        return SparseMoE(router, experts, shared, shard)
