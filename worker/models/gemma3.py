"""Gemma 3 text (gemma3_text): the dense Llama shape with Gemma's differences. Embeddings times sqrt(hidden_size);
(1 + w) RMSNorms everywhere, four a layer (sandwich: each block's input and output normed, the output before the
residual add); per-head q/k norm; softmax scale query_pre_attn_scalar ** -0.5; a gated MLP with the tanh GELU;
sliding and full layers as `layer_types` says (five to one), each type with its own rope settings
(worker/rope.py, `LayerRotary`); tied embeddings; `final_logit_softcapping` where set (worker/models/decoder.py).
transformers' Gemma 3 reads `attn_logit_softcapping` but its attention does not apply it: neither does Lockstep."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from cluster.errors import UnsupportedModel
from worker.attention import AttnMeta, StepMasks
from worker.checkpoint_names import NameRule, NameTable
from worker.gated_mlp import GatedMLP, activation
from worker.layers import GemmaRMSNorm, Shard
from worker.models.decoder import DecoderLayer
from worker.models.llama import DENSE_NAMES, Llama
from worker.rope import StepRotary
from worker.self_attention import AttentionOptions

SANDWICH_NAMES = NameTable(tuple(NameRule(f"model.layers.{{L}}.{norm}.{{kind}}", f"layers.{{L}}.{norm}")
                                 for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm")))


class SandwichLayer(DecoderLayer):
    """h + post_attention_layernorm(attn(input_layernorm(h))), then
    h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))), every norm Gemma's."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module, dtype: torch.dtype):
        super().__init__(config, attention, mlp, dtype, GemmaRMSNorm)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, h: torch.Tensor, meta: AttnMeta, rope: StepRotary, masks: StepMasks, real: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), meta, rope, masks, k_cache, v_cache)
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), real))


class Gemma3(Llama):
    model_types = ("gemma3_text",)
    names = DENSE_NAMES + SANDWICH_NAMES
    norm_class = GemmaRMSNorm
    qk_norm: ClassVar[bool] = True  # per-head q/k norms (Gemma 2 has none)

    @classmethod
    def check(cls, config: Any) -> None:
        super().check(config)
        activation(config.hidden_activation)
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModel("use_bidirectional_attention=True is not supported (causal decoding only)")

    @classmethod
    def embedding_scale(cls, config: Any) -> float | None:
        return config.hidden_size ** 0.5

    def attention_options(self, config: Any) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=self.qk_norm, norm=GemmaRMSNorm,
                                scale=config.query_pre_attn_scalar ** -0.5, softcap=self.score_softcap(config))

    def score_softcap(self, config: Any) -> float | None:
        """The attention scores' cap: none for Gemma 3 (see the module's docstring)."""
        return None

    def make_mlp(self, config: Any, shard: Shard, layer: int, dtype: torch.dtype) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, False, shard, dtype,
                        act=config.hidden_activation)

    def make_layer(self, config: Any, shard: Shard, layer: int, window: int | None, dtype: torch.dtype) -> nn.Module:
        return SandwichLayer(config, self.make_attention(config, shard, layer, window, dtype),
                             self.make_mlp(config, shard, layer, dtype), dtype)
