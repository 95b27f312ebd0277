"""The dense Llama shape: Llama, Mistral (every layer windowed when `sliding_window` is set) and Qwen2 (biases on
q, k and v, none on o). Attention and a gated SiLU MLP a layer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.gated_mlp import GatedMLP, mlp_names
from worker.layers import Shard
from worker.models.decoder import BASE_NAMES, CausalLM
from worker.self_attention import ATTENTION_NAMES, AttentionOptions, SelfAttention

DENSE_NAMES = BASE_NAMES + ATTENTION_NAMES + mlp_names("mlp")


class Llama(CausalLM):
    model_types = ("llama",)
    names = DENSE_NAMES

    def attention_options(self, config: Any) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    def make_attention(self, config: Any, shard: Shard, layer: int, window: int | None,
                       dtype: torch.dtype) -> nn.Module:
        return SelfAttention(config, shard, window, self.attention_options(config), dtype)

    def make_mlp(self, config: Any, shard: Shard, layer: int, dtype: torch.dtype) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)),
                        shard, dtype)


class Mistral(Llama):
    model_types = ("mistral",)

    def layer_windows(self, config: Any) -> list[int | None]:
        return [getattr(config, "sliding_window", None)] * config.num_hidden_layers


class Qwen2(Llama):
    model_types = ("qwen2",)

    def attention_options(self, config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)
