"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2), with its compressed KV cache and absorbed weights
(docs/models.md, "MLA's cache layout").

A token's keys and values are cached as what they are computed from: the normed latent `c` (`kv_lora_rank` wide,
the first part of `kv_a_proj_with_mqa`'s output) and the rotated rope key `k_r` (`qk_rope_head_dim`, shared by
every head), one row [c | k_r] a token and layer, a single "KV head" of width kv_lora_rank + qk_rope_head_dim.
Head h's key and value would be k_h = [W_uk_h c | k_r], v_h = W_uv_h c (`kv_b_proj`'s rows of head h: nope rows,
then value rows). Attention runs on the cache as it is, with the up-projections absorbed into the query and the
output:

  q_h . k_h = (W_uk_h^T q_nope_h) . c + q_rope_h . k_r    (the query [W_uk_h^T q_nope_h | q_rope_h] over the rows)
  sum_j p_j v_h,j = W_uv_h (sum_j p_j c_j)                 (attend with the rows as values, keep the c part)

so every path that attends over (k_cache, v_cache) (the CPU's paged SDPA, the Triton kernel, flash-attn's, see
worker/attention.py) runs MLA unchanged with one KV head, the same tensor as keys and values, and a query of
width kv_lora_rank + qk_rope_head_dim; the output's rope columns are dropped. The same for prefill and decode:
equal to transformers' expanded attention up to float32 rounding (the products are grouped differently).

Tensor parallelism splits the heads: q_b_proj (or q_proj), kv_b_proj and o_proj hold this rank's heads; the
latent and rope key are computed whole on every rank (`kv_a_proj_with_mqa`, `q_a_proj` and their norms are
replicated), since every head reads them, so each rank caches the same rows."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cluster.errors import UnsupportedModel
from worker.attention import AttnMeta, StepMasks, paged_attention
from worker.checkpoint_names import NameRule, NameTable
from worker.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, Shard
from worker.rope import StepRotary, rope_parameters, yarn_mscale

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm ignore rms_norm_eps


def softmax_scale(config: Any) -> float:
    """(qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared when the
    rope is scaled and sets mscale_all_dim, as transformers' DeepSeek-V3 attention computes it."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * m * m
    return scale


def replicated(in_features: int, parts: dict[str, int], bias: bool, dtype: torch.dtype) -> ColumnParallelLinear:
    """A linear held whole on every rank: `parts` (name -> rows) fused in that order."""
    return ColumnParallelLinear(in_features, {p: (rows, 0, rows) for p, rows in parts.items()}, bias, dtype)


class LatentAttention(nn.Module):
    """One MLA layer on this rank's heads; its cache is [slots + 1 page, 1, kv_lora_rank + qk_rope_head_dim]."""

    def __init__(self, config: Any, shard: Shard, dtype: torch.dtype):
        super().__init__()
        heads = config.num_attention_heads
        if heads % shard.size:
            raise UnsupportedModel(f"num_attention_heads={heads} does not split over tp={shard.size} ranks")
        self.h = h = heads // shard.size
        first = shard.rank * h
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.latent, self.q_lora = config.kv_lora_rank, config.q_lora_rank
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        self.scale = softmax_scale(config)
        qk, bias = self.nope + self.rope_dim, bool(getattr(config, "attention_bias", False))
        q_rows = (h * qk, first * qk, heads * qk)
        # the projections of the hidden states held whole on every rank, fused: q_a (with q_lora_rank), kv_a
        a_parts = {"q_a": self.q_lora} if self.q_lora else {}
        self.a_proj = replicated(config.hidden_size, a_parts | {"kv_a": self.latent + self.rope_dim}, bias, dtype)
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(self.q_lora, LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora, {"": q_rows}, False, dtype)
        else:
            self.q_proj = ColumnParallelLinear(config.hidden_size, {"": q_rows}, False, dtype)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS, dtype)
        per_head = self.nope + self.v_dim
        self.kv_b_proj = ColumnParallelLinear(self.latent, {"": (h * per_head, first * per_head, heads * per_head)},
                                              False, dtype)
        self.o_proj = RowParallelLinear(heads * self.v_dim, config.hidden_size, bias, shard, dtype)

    def _rotate(self, rope: StepRotary, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, rope dim] rotated. Interleaved (`rope_interleave`: pairs (x0, x1), (x2, x3), ...): the even
        columns then the odd ones, rotated in the rotate-half convention, which is transformers'
        `apply_rotary_pos_emb_interleave` value for value; queries and keys alike, so their products are."""
        if self.interleaved:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return rope.apply(x)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [h, nope, latent], W_uv [h, v, latent]): views of this rank's kv_b_proj rows (an update of
        kv_b_proj is what the next forward reads)."""
        w = self.kv_b_proj.weight.view(self.h, self.nope + self.v_dim, self.latent)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, x: torch.Tensor, meta: AttnMeta, rope: StepRotary, masks: StepMasks, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] (o_proj's all-reduce: every rank of the device group calls it). Writes the
        step's [latent | rope key] rows into `k_cache` (the cache holds no values: `v_cache` is the same tensor)."""
        t, h = x.shape[0], self.h
        a = self.a_proj(x)
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(a[:, :self.q_lora]))
            kv = a[:, self.q_lora:]
        else:
            q, kv = self.q_proj(x), a
        q = q.reshape(t, h, self.nope + self.rope_dim)
        latent = self.kv_a_layernorm(kv[:, :self.latent])
        k_rope = self._rotate(rope, kv[:, None, self.latent:])
        k_cache.index_copy_(0, meta.slot_mapping, torch.cat([latent[:, None, :], k_rope], dim=-1))
        w_uk, w_uv = self._absorbed()
        q_latent = torch.bmm(q[..., :self.nope].transpose(0, 1), w_uk).transpose(0, 1)  # [T, h, latent]
        query = torch.cat([q_latent, self._rotate(rope, q[..., self.nope:])], dim=-1).contiguous()
        out = paged_attention(query, k_cache, k_cache, meta, None, self.scale, masks)  # [T, h, latent + rope]
        values = torch.bmm(out[..., :self.latent].transpose(0, 1), w_uv.transpose(1, 2))  # [h, T, v]
        return self.o_proj(values.transpose(0, 1).reshape(t, h * self.v_dim))


def _rule(name: str, module: str, part: str = "") -> NameRule:
    return NameRule(f"model.layers.{{L}}.self_attn.{name}.{{kind}}", f"layers.{{L}}.self_attn.{module}", part)


# transformers' (and the published checkpoints') names of an MLA layer's tensors
LATENT_ATTENTION_NAMES = NameTable((
    _rule("q_a_proj", "a_proj", "q_a"), _rule("kv_a_proj_with_mqa", "a_proj", "kv_a"),
    _rule("q_a_layernorm", "q_a_layernorm"), _rule("q_b_proj", "q_b_proj"), _rule("q_proj", "q_proj"),
    _rule("kv_a_layernorm", "kv_a_layernorm"), _rule("kv_b_proj", "kv_b_proj"), _rule("o_proj", "o_proj"),
))
