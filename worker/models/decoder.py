"""What every family shares: the pre-norm decoder layer and the sharded causal LM around it (embedding, layers,
final norm, vocab-parallel head, rotary tables), and the mapping between checkpoint names and layers through the
family's `NameTable`. A family (worker/models/<family>.py) subclasses `CausalLM`, names its model types and
table, and says how each layer is made (`make_attention`, `make_mlp`, `make_layer`, `layer_windows`), its norm's
form (`norm_class`), and whether embeddings are scaled (`embedding_scale`); `final_logit_softcapping`, where a
config sets it, caps the logits as transformers does."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from cluster.errors import UnsupportedModel
from worker.attention import AttnMeta, StepMasks, step_masks
from worker.checkpoint_names import NameRule, NameTable, Target
from worker.layers import ParallelLMHead, RMSNorm, Shard, VocabParallelEmbedding
from worker.rope import LayerRotary, StepRotary
from worker.self_attention import KVHeads, head_dim_of

BASE_NAMES = NameTable((
    NameRule("model.embed_tokens.{kind}", "embed_tokens"),
    NameRule("model.norm.{kind}", "norm"),
    NameRule("lm_head.{kind}", "lm_head"),
    NameRule("model.layers.{L}.input_layernorm.{kind}", "layers.{L}.input_layernorm"),
    NameRule("model.layers.{L}.post_attention_layernorm.{kind}", "layers.{L}.post_attention_layernorm"),
))


class DecoderLayer(nn.Module):
    """h + attn(norm(h)), then h + mlp(norm(h)); `mlp` is any block of one all-reduce (dense or experts), called
    with the hidden states and the step's real-token mask [T] (False on padding rows)."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module, dtype: torch.dtype,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = attention
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = mlp

    def forward(self, h: torch.Tensor, meta: AttnMeta, rope: StepRotary, masks: StepMasks, real: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), meta, rope, masks, k_cache, v_cache)
        return h.add_(self.mlp(self.post_attention_layernorm(h), real))


class CausalLM(nn.Module):
    """The sharded model. `forward` returns this rank's slice of the logits of `meta.logits_idx`."""

    model_types: ClassVar[tuple[str, ...]] = ()  # transformers' `model_type`s this family serves
    names: ClassVar[NameTable] = BASE_NAMES  # checkpoint name <-> layer
    norm_class: ClassVar[type[RMSNorm]] = RMSNorm  # the layers' and the final norm's form
    impl: ClassVar[str] = "native"  # which path serves the model: "native" (a family) or "generic" (worker/generic/)
    embed_name: ClassVar[str] = "model.embed_tokens.weight"  # the embedding's checkpoint name (a tied head's too)
    # whether the KV pages cache values apart from keys; False: one tensor a layer read as both (MLA's latent)
    kv_values: ClassVar[bool] = True

    def __init__(self, config: Any, shard: Shard, dtype: torch.dtype, device: torch.device,
                 expert_parallel: bool = False):
        super().__init__()
        self.check(config)
        self.config, self.shard = config, shard
        self.expert_parallel = expert_parallel  # MoE families: whole experts per rank (worker/experts.py)
        self.windows = self.layer_windows(config)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        with torch.device(device):  # every parameter and buffer is made on `device`, whatever the caller's default
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard, dtype)
            scale = self.embedding_scale(config)  # as transformers holds it: a float32 tensor cast to the dtype
            self.register_buffer("embed_scale", None if scale is None else torch.tensor(scale).to(dtype),
                                 persistent=False)
            self.layers = nn.ModuleList(self.make_layer(config, shard, i, w, dtype) for i, w in enumerate(self.windows))
            self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, shard, dtype)
            if self.tied:
                self.lm_head.weight = self.embed_tokens.weight
            self.rope = LayerRotary(config, head_dim_of(config), config.max_position_embeddings, device)
        self.softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self._expected: frozenset[str] | None = None

    # -- what a family says ------------------------------------------------------------------------------------

    @classmethod
    def check(cls, config: Any) -> None:
        """Refuse a config this family cannot serve exactly (by name)."""
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")

    def layer_windows(self, config: Any) -> list[int | None]:
        """Sliding-window size of each layer (None: full attention)."""
        window = getattr(config, "sliding_window", None)
        if types := getattr(config, "layer_types", None):
            return [window if t == "sliding_attention" else None for t in types]
        return [window if getattr(config, "use_sliding_window", False) else None] * config.num_hidden_layers

    @classmethod
    def embedding_scale(cls, config: Any) -> float | None:
        """What the embeddings are multiplied by (Gemma: sqrt(hidden_size)); None: nothing."""
        return None

    def make_layer(self, config: Any, shard: Shard, layer: int, window: int | None, dtype: torch.dtype) -> nn.Module:
        """Layer `layer`: called as DecoderLayer is (hidden states, meta, its rope, masks, real mask, its caches)."""
        return DecoderLayer(config, self.make_attention(config, shard, layer, window, dtype),
                            self.make_mlp(config, shard, layer, dtype), dtype, self.norm_class)
    def kv_layout(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head dim) of this rank's attention: what its KV pages are shaped for."""
        heads = KVHeads(self.config, self.shard)
        return heads.q_local, heads.kv_local, head_dim_of(self.config)

    def describe(self) -> str:
        """Which path serves the model, for the startup log."""
        return f"native family {type(self).__name__} (worker/models/)"

    def make_attention(self, config: Any, shard: Shard, layer: int, window: int | None,
                       dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    def make_mlp(self, config: Any, shard: Shard, layer: int, dtype: torch.dtype) -> nn.Module:
        raise NotImplementedError

    # -- the forward -------------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, meta: AttnMeta, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor], project: bool = True) -> torch.Tensor:
        """Every rank of the device group calls it: two all-reduces a layer, one for the embedding.
        The per-step metadata (rope cos/sin at the step's positions, the decode masks, which tokens are real) is
        computed once here. `project` False: the head's inputs of meta's rows (the final norm's output), which
        `project` turns into logits later, a few rows at a time (prompt scoring: worker/prompt_scoring.py)."""
        h = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        ropes = self.rope.at(meta.positions, h.dtype)  # each layer's (a table per rope setting, gathered once)
        masks = step_masks(meta, self.windows, h.dtype)
        real = meta.slot_mapping < meta.scratch_slot
        for layer, rope, kc, vc in zip(self.layers, ropes, k_caches, v_caches):
            h = layer(h, meta, rope, masks, real, kc, vc)
        heads = self.norm(h.index_select(0, meta.logits_idx))
        return self.project(heads) if project else heads

    def project(self, heads: torch.Tensor) -> torch.Tensor:
        """This rank's logits shard of rows of the head's inputs (`forward` with project=False): the LM head, then
        the family's post-processing of logits (the final softcap), so every consumer sees the same logits."""
        logits = self.lm_head(heads)
        if self.softcap is not None:  # transformers' order: divide, tanh, multiply
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    # -- checkpoint names --------------------------------------------------------------------------------------

    def target(self, name: str) -> Target | None:
        """What loads checkpoint tensor `name`, or None if it is not one of this model's (a tied head's name is
        not: the embedding's covers it)."""
        found = self.names.from_checkpoint(name)
        if found is None:
            return None
        rule, (path, part, kind) = found
        try:
            layer = self.get_submodule(path)
        except AttributeError:  # e.g. a dense layer's name for a layer with experts, or a layer past the last
            return None
        if not hasattr(layer, "shard_of") or (layer is self.lm_head and self.tied):
            return None
        if not rule.alias:
            return Target(layer, part, kind, (name,)) if name in self.expected_tensors() else None
        covers = tuple(self.names.to_checkpoint(path, p, kind) for p in layer.covered_parts(part))
        return Target(layer, part, kind, covers)

    def expected_tensors(self) -> frozenset[str]:
        """Checkpoint names a complete load must find: one for each part of each loading layer, in the published
        layout (a tied head's is the embedding's)."""
        if self._expected is None:
            self._expected = frozenset(
                self.names.to_checkpoint(path, part, kind)
                for path, layer in self.named_modules() if hasattr(layer, "checkpoint_parts")
                and not (layer is self.lm_head and self.tied) for part, kind in layer.checkpoint_parts())
        return self._expected
