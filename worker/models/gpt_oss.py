"""gpt-oss (gpt_oss): the Llama shape with biases on q, k, v and o (`attention_bias`), a learned sink logit a query
head in every attention softmax (`self_attn.sinks`, worker/attention.py `ScoreTerms`), sliding-window and full
layers alternating as `layer_types` says (`sliding_window` keys for the sliding ones), yarn RoPE (worker/rope.py),
and on every layer `num_local_experts` experts under a biased router: top-k of the logits, then a softmax over
the k chosen (worker/routers.py `BiasedTopKSoftmax`), the experts biased with a clamped SwiGLU and transformers'
interleaved gate/up layout (worker/clamped_experts.py). The checkpoint names are transformers' own
(`mlp.router.{weight,bias}`, `mlp.experts.{gate_up_proj,down_proj}[_bias]`, `self_attn.sinks`). OpenAI's published
MXFP4 checkpoints (a `quantization_config`) are refused: dequantized ones (bfloat16) load."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cluster.errors import UnsupportedModel
from worker.checkpoint_names import NameRule, NameTable
from worker.clamped_experts import PARTS, ClampedExperts
from worker.layers import Shard
from worker.models.llama import Llama
from worker.models.decoder import BASE_NAMES
from worker.models.qwen3_moe import placement
from worker.moe_block import SparseMoE
from worker.routers import BiasedTopKSoftmax
from worker.self_attention import ATTENTION_NAMES, AttentionOptions

MOE_NAMES = NameTable((NameRule("model.layers.{L}.mlp.router.{kind}", "layers.{L}.mlp.router"),
                       *(NameRule(f"model.layers.{{L}}.mlp.experts.{part}", "layers.{L}.mlp.experts", part)
                         for part in PARTS)))


class GptOss(Llama):
    model_types = ("gpt_oss",)
    names = BASE_NAMES + ATTENTION_NAMES + MOE_NAMES

    @classmethod
    def check(cls, config: Any) -> None:
        super().check(config)
        quantized = getattr(config, "quantization_config", None)
        if quantized:
            method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
            raise UnsupportedModel(f"a quantized gpt-oss checkpoint (quantization_config: {method}) is not "
                                   f"supported: serve a dequantized (bfloat16) one")

    def attention_options(self, config: Any) -> AttentionOptions:
        bias = bool(config.attention_bias)
        return AttentionOptions(qkv_bias=bias, o_bias=bias, sinks=True)

    def make_mlp(self, config: Any, shard: Shard, layer: int, dtype: torch.dtype) -> nn.Module:
        router = BiasedTopKSoftmax(config.num_local_experts, config.hidden_size, config.num_experts_per_tok, dtype)
        where = placement(config.num_local_experts, config.intermediate_size, shard, self.expert_parallel)
        experts = ClampedExperts(config.hidden_size, where, config.swiglu_limit, config.swiglu_alpha, dtype)
        return SparseMoE(router, experts, None, shard)
