"""Qwen3: the dense Llama shape with a per-head RMSNorm of q and k before rotary."""

from __future__ import annotations

from typing import Any

from worker.models.llama import Llama
from worker.self_attention import AttentionOptions


class Qwen3(Llama):
    model_types = ("qwen3",)

    def attention_options(self, config: Any) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
