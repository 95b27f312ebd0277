"""DeepSeek-V3 (deepseek_v3; Kimi-K2 ships as it): multi-head latent attention (worker/latent_attention.py: the KV
pages hold each token's compressed latent and rope key, one row a layer, attended with absorbed weights) and
GLM-4.5's feed-forward, which is DeepSeek-V3's: the first `first_k_dense_replace` layers dense, the rest the
group-limited sigmoid router (`n_group`, `topk_group`, `routed_scaling_factor`, `e_score_correction_bias`) over
`n_routed_experts` experts plus `n_shared_experts` shared ones (worker/models/glm4_moe.py).

Multi-token prediction: a checkpoint's MTP modules (`num_nextn_predict_layers` of them, DeepSeek-V3's layer 61) are
stored as layers at index >= `num_hidden_layers`. transformers' DeepSeek-V3 does not build them (it ignores their
tensors at load) and Lockstep serves the base model as transformers does: their tensors are skipped at load, as any
tensor naming a layer past the last is; a partial update naming one is refused as an unknown tensor."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.gated_mlp import mlp_names
from worker.latent_attention import LATENT_ATTENTION_NAMES, LatentAttention
from worker.layers import Shard
from worker.models.decoder import BASE_NAMES
from worker.models.glm4_moe import Glm4Moe
from worker.moe_block import ExpertNames


class DeepseekV3(Glm4Moe):
    model_types = ("deepseek_v3",)
    names = (BASE_NAMES + LATENT_ATTENTION_NAMES + mlp_names("mlp")
             + ExpertNames(shared="shared_experts", correction=True).table())
    kv_values = False  # the latent rows are read as keys and as values

    def make_attention(self, config: Any, shard: Shard, layer: int, window: int | None,
                       dtype: torch.dtype) -> nn.Module:
        return LatentAttention(config, shard, dtype)

    def layer_windows(self, config: Any) -> list[int | None]:
        return [None] * config.num_hidden_layers  # no sliding window

    def kv_layout(self) -> tuple[int, int, int]:
        """This rank's query heads; one cached row a token: [latent | rope key]."""
        attn = self.layers[0].self_attn
        return attn.h, 1, self.config.kv_lora_rank + self.config.qk_rope_head_dim
