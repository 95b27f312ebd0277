"""The sharded self-attention block every family composes: fused q/k/v projection (this rank's heads), optional
per-head q/k RMSNorm (Llama's or Gemma's form), rotary (full or partial), the paged attention of
worker/attention.py at the family's softmax scale, with its score terms (gpt-oss's per-head sinks, this rank's
heads' in `HeadSinks`; Gemma 2's score softcap), and the output projection's all-reduce. A family says which of
the options it has (`AttentionOptions`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cluster.errors import UnsupportedModel
from worker.attention import PLAIN, AttnMeta, ScoreTerms, StepMasks, paged_attention, write_kv
from worker.checkpoint_names import NameRule, NameTable
from worker.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, Shard, expect_shape
from worker.rope import StepRotary


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class KVHeads:
    """Which query and KV heads live on this rank; KV heads are replicated when TP exceeds their count."""

    def __init__(self, config: Any, shard: Shard):
        hq, hkv, tp = config.num_attention_heads, config.num_key_value_heads, shard.size
        if hq % tp:
            raise UnsupportedModel(f"num_attention_heads={hq} does not split over tp={tp} ranks")
        if hkv >= tp and hkv % tp:
            raise UnsupportedModel(f"num_key_value_heads={hkv} does not split over tp={tp} ranks")
        if hkv < tp and tp % hkv:
            raise UnsupportedModel(f"tp={tp} is not a multiple of num_key_value_heads={hkv}")
        self.q_local, self.kv_local = hq // tp, max(1, hkv // tp)
        self.q_start = shard.rank * self.q_local
        self.kv_start = shard.rank * self.kv_local if hkv >= tp else shard.rank * hkv // tp


@dataclass(frozen=True)
class AttentionOptions:
    qkv_bias: bool = False  # biases on q, k and v
    o_bias: bool = False  # a bias on the output projection
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3, GLM-4 MoE's use_qk_norm, Gemma 3)
    norm: type[RMSNorm] = RMSNorm  # the q/k norm's form (Gemma: GemmaRMSNorm, (1 + w))
    scale: float | None = None  # the softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    sinks: bool = False  # a learned sink logit a query head (gpt-oss's `self_attn.sinks`)
    softcap: float | None = None  # scores capped to tanh(s / cap) * cap (Gemma 2's attn_logit_softcapping)


class HeadSinks(nn.Module):
    """This rank's query heads' sinks [Hq_local] (the checkpoint's `sinks` [num_attention_heads], sliced as the
    query heads are)."""

    def __init__(self, heads: KVHeads, total: int, dtype: torch.dtype):
        super().__init__()
        self.first, self.total = heads.q_start, total
        self.weight = nn.Parameter(torch.zeros(heads.q_local, dtype=dtype), requires_grad=False)

    def shard_of(self, part: str, kind: str, src: Any) -> tuple[torch.Tensor, torch.Tensor]:
        expect_shape(src, (self.total,))
        return self.weight.data, src[self.first:self.first + self.weight.shape[0]]

    def checkpoint_parts(self) -> list[tuple[str, str]]:
        return [("", "weight")]

    def view(self, part: str, kind: str) -> torch.Tensor:
        return self.weight.data


class SelfAttention(nn.Module):
    def __init__(self, config: Any, shard: Shard, window: int | None, options: AttentionOptions,
                 dtype: torch.dtype):
        super().__init__()
        d = head_dim_of(config)
        heads = KVHeads(config, shard)
        self.d, self.hq, self.hkv, self.window = d, heads.q_local, heads.kv_local, window
        self.scale = d ** -0.5 if options.scale is None else options.scale
        kv = (heads.kv_local * d, heads.kv_start * d, config.num_key_value_heads * d)  # rows here, first, in all
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, {
            "q": (heads.q_local * d, heads.q_start * d, config.num_attention_heads * d), "k": kv, "v": kv},
            bias=options.qkv_bias, dtype=dtype)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, options.o_bias, shard,
                                        dtype)
        self.qk_norm = options.qk_norm
        if options.sinks:
            self.sinks = HeadSinks(heads, config.num_attention_heads, dtype)
        self.softcap = options.softcap
        if self.qk_norm:
            self.q_norm = options.norm(d, config.rms_norm_eps, dtype)
            self.k_norm = options.norm(d, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, meta: AttnMeta, rope: StepRotary, masks: StepMasks, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        t, hq, hkv, d = x.shape[0], self.hq, self.hkv, self.d
        qkv = self.qkv_proj(x).contiguous()  # attention's CPU kernel wants rows (see layers.linear)
        v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        if self.qk_norm:
            q, k = rope.apply(self.q_norm(qkv[:, :hq * d].view(t, hq, d))), \
                rope.apply(self.k_norm(qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)))
        else:  # q and k are adjacent columns: rotated together, as [T, Hq + Hkv, D]
            qk = rope.apply(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d))
            q, k = qk[:, :hq], qk[:, hq:]
        write_kv(k_cache, v_cache, k, v, meta)
        out = paged_attention(q, k_cache, v_cache, meta, self.window, self.scale, masks, self.terms())
        return self.o_proj(out.reshape(t, hq * d))

    def terms(self) -> ScoreTerms:
        """This layer's score terms (the sinks read at the call: a weight update replaces their values in place)."""
        sinks = self.sinks.weight if hasattr(self, "sinks") else None
        return PLAIN if sinks is None and self.softcap is None else ScoreTerms(sinks, self.softcap)


ATTENTION_NAMES = NameTable(tuple(
    NameRule(f"model.layers.{{L}}.self_attn.{p}_proj.{{kind}}", "layers.{L}.self_attn.qkv_proj", p)
    for p in ("q", "k", "v")) + (
    NameRule("model.layers.{L}.self_attn.o_proj.{kind}", "layers.{L}.self_attn.o_proj"),
    NameRule("model.layers.{L}.self_attn.q_norm.{kind}", "layers.{L}.self_attn.q_norm"),
    NameRule("model.layers.{L}.self_attn.k_norm.{kind}", "layers.{L}.self_attn.k_norm"),
    NameRule("model.layers.{L}.self_attn.sinks", "layers.{L}.self_attn.sinks"),
))
