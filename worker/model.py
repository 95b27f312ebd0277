"""One sharded decoder for the Llama family: Llama, Mistral, Qwen2 (QKV bias) and Qwen3 (q/k norm).

The architectures differ only in a few switches read from the transformers config, so one module serves
all four. Every rank builds the same module tree holding only its shard; `target` maps a checkpoint tensor
name to the layer that loads it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.attention import AttnMeta, StepMasks, paged_attention, step_masks, write_kv
from worker.layers import (ColumnParallelLinear, ParallelLMHead, RMSNorm, RowParallelLinear, Shard,
                           VocabParallelEmbedding)
from worker.rope import RotaryTable, StepRotary

# the checkpoint tensors each fused layer loads
UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")  # model_type


def check_supported(config) -> None:
    if config.model_type not in SUPPORTED_ARCHS:
        raise ValueError(f"model_type {config.model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_windows(config) -> list[int | None]:
    """Sliding-window size of each layer (None: full attention)."""
    window = getattr(config, "sliding_window", None)
    if types := getattr(config, "layer_types", None):
        return [window if t == "sliding_attention" else None for t in types]
    sliding = config.model_type == "mistral" or getattr(config, "use_sliding_window", False)
    return [window if sliding else None] * config.num_hidden_layers


class KVHeads:
    """Which query and KV heads live on this rank; KV heads are replicated when TP exceeds their count."""

    def __init__(self, config, shard: Shard):
        hq, hkv, tp = config.num_attention_heads, config.num_key_value_heads, shard.size
        if hq % tp:
            raise ValueError(f"num_attention_heads={hq} does not split over tp={tp} ranks")
        if hkv >= tp and hkv % tp:
            raise ValueError(f"num_key_value_heads={hkv} does not split over tp={tp} ranks")
        if hkv < tp and tp % hkv:
            raise ValueError(f"tp={tp} is not a multiple of num_key_value_heads={hkv}")
        self.q_local, self.kv_local = hq // tp, max(1, hkv // tp)
        self.q_start = shard.rank * self.q_local
        self.kv_start = shard.rank * self.kv_local if hkv >= tp else shard.rank * hkv // tp


class Attention(nn.Module):
    def __init__(self, config, shard: Shard, window: int | None, dtype: torch.dtype):
        super().__init__()
        d = head_dim_of(config)
        heads = KVHeads(config, shard)
        self.d, self.hq, self.hkv, self.window, self.scale = d, heads.q_local, heads.kv_local, window, d ** -0.5
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        kv = (heads.kv_local * d, heads.kv_start * d, config.num_key_value_heads * d)  # rows here, first, in all
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, {
            "q": (heads.q_local * d, heads.q_start * d, config.num_attention_heads * d), "k": kv, "v": kv},
            bias=bias, dtype=dtype)
        o_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, o_bias, shard, dtype)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype)

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
        out = paged_attention(q, k_cache, v_cache, meta, self.window, self.scale, masks)
        return self.o_proj(out.reshape(t, hq * d))


class MLP(nn.Module):
    def __init__(self, config, shard: Shard, dtype: torch.dtype):
        super().__init__()
        inter = config.intermediate_size
        if inter % shard.size:
            raise ValueError(f"intermediate_size={inter} does not split over tp={shard.size} ranks")
        self.rows = rows = inter // shard.size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, {
            "gate": (rows, shard.rank * rows, inter), "up": (rows, shard.rank * rows, inter)}, bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, shard, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.rows, self.rows], dim=-1)
        return self.down_proj(nn.functional.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config, shard: Shard, window: int | None, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, shard, window, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, shard, dtype)

    def forward(self, h: torch.Tensor, meta: AttnMeta, rope: StepRotary, masks: StepMasks, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), meta, rope, masks, k_cache, v_cache)
        return h.add_(self.mlp(self.post_attention_layernorm(h)))


class CausalLM(nn.Module):
    """The sharded model. `forward` returns this rank's slice of the logits of `meta.logits_idx`."""

    def __init__(self, config, shard: Shard, dtype: torch.dtype, device: torch.device):
        super().__init__()
        check_supported(config)
        self.config, self.shard = config, shard
        self.windows = layer_windows(config)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        with torch.device(device):  # every parameter and buffer is made on `device`, whatever the caller's default
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard, dtype)
            self.layers = nn.ModuleList(DecoderLayer(config, shard, w, dtype) for w in self.windows)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, shard, dtype)
            if self.tied:
                self.lm_head.weight = self.embed_tokens.weight
            self.rope = RotaryTable(config, head_dim_of(config), config.max_position_embeddings, device)

    def forward(self, input_ids: torch.Tensor, meta: AttnMeta, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor]) -> torch.Tensor:
        """Every rank of the device group calls it: two all-reduces a layer, one for the embedding.
        The per-step metadata (rope cos/sin at the step's positions, the decode masks) is computed once here."""
        h = self.embed_tokens(input_ids)
        rope = self.rope.at(meta.positions, h.dtype)
        masks = step_masks(meta, self.windows, h.dtype)
        for layer, kc, vc in zip(self.layers, k_caches, v_caches):
            h = layer(h, meta, rope, masks, kc, vc)
        return self.lm_head(self.norm(h.index_select(0, meta.logits_idx)))

    def target(self, name: str) -> tuple[Any, str, str] | None:
        """(layer, part, 'weight'|'bias') that loads checkpoint tensor `name`, or None if it is not ours."""
        parts = name.split(".")
        kind = parts[-1]
        if name == "lm_head.weight":
            return (self.lm_head, "", kind) if not self.tied else None
        if parts[0] != "model":
            return None
        if parts[1] in ("embed_tokens", "norm"):
            return getattr(self, parts[1]), "", kind
        if parts[1] != "layers":
            return None
        layer = self.layers[int(parts[2])]
        block, proj = parts[3], parts[4]
        if block in ("input_layernorm", "post_attention_layernorm"):
            return getattr(layer, block), "", kind
        if block in ("self_attn", "mlp"):
            fused = next((f for f, unfused in UNFUSED.items() if proj in unfused), None)
            if fused is not None:  # q_proj -> (qkv_proj, "q"), gate_proj -> (gate_up_proj, "gate") ...
                return getattr(getattr(layer, block), fused), proj.split("_")[0], kind
            return (getattr(layer.self_attn, proj) if block == "self_attn" else layer.mlp.down_proj), "", kind
        return None

    def expected_tensors(self) -> set[str]:
        """Checkpoint names a complete load must find: every parameter's (a tied head's is the embedding's), unfused."""
        names = set()
        for name, _ in self.named_parameters():
            *path, module, kind = name.split(".")
            prefix = [] if name.startswith("lm_head.") else ["model"]
            names |= {".".join(prefix + path + [part, kind]) for part in UNFUSED.get(module, (module,))}
        return names
