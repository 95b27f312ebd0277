"""What the generic path cannot serve, refused at load with `ModelRefused` naming the layer and the reason: before
the model is built, from its config (`check_config`); after, from what its layers handed the attention function in
the load-time probe (`check_probe`, worker/generic/attention.py). The tensor-parallel plan's own refusals are in
worker/generic/tp_plan.py."""

from __future__ import annotations

from typing import Any

from cluster.errors import ModelRefused
from worker.generic.attention import LayerCall, Probe
from worker.generic.tp_plan import base_plan

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def causal_lm_class(config: Any) -> type:
    """transformers' causal-LM class for `config`, or ModelRefused."""
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        raise ModelRefused(config.model_type, None, "transformers has no causal language model class for it "
                                                    "(AutoModelForCausalLM does not map its config)")
    return mapping[type(config)]


def check_config(config: Any, tp: int) -> None:
    """Refuse, before anything is built, what the config alone shows the generic path cannot serve."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    kind = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise ModelRefused(kind, None, "an encoder-decoder model (the generic path serves decoders only)")
    if getattr(config, "add_cross_attention", False):
        raise ModelRefused(kind, None, "its layers have cross-attention (add_cross_attention=True)")
    for i, layer_type in enumerate(getattr(config, "layer_types", None) or []):
        if layer_type not in ATTENTION_LAYER_TYPES:
            raise ModelRefused(kind, f"layer {i}", f"a {layer_type!r} layer (the generic path serves "
                                                   f"{' and '.join(ATTENTION_LAYER_TYPES)} layers only)")
    name = causal_lm_class(config).__name__
    if get_checkpoint_conversion_mapping(kind) or get_checkpoint_conversion_mapping(name):
        raise ModelRefused(kind, None, f"transformers converts its checkpoints' tensors at load (conversion_mapping.py "
                                       f"for {kind} or {name}: renamed or fused tensors), which the generic path "
                                       f"does not")
    if tp > 1 and not base_plan(config):
        raise ModelRefused(kind, None, f"its config declares no base_model_tp_plan: the generic path serves it at "
                                       f"TP=1 only, not tp={tp}")


def _layer_refusal(call: LayerCall) -> str | None:
    if call.kv_len != call.q_len:
        return f"cross-attention ({call.module} attends to {call.kv_len} keys for {call.q_len} queries)"
    if not call.causal:
        return f"{call.module} is not causal (is_causal=False)"
    if call.masked:
        return (f"{call.module} is given an attention mask of the model's own (a position bias such as ALiBi, or a "
                f"non-causal pattern), which paged attention cannot apply")
    if call.softcap is not None:
        return (f"attention logit softcapping ({call.softcap}) is not in the generic path's attention (native "
                f"families pass it to Lockstep's: serve it with model_impl='auto' where one exists)")
    if call.sinks:
        return ("attention sinks are not in the generic path's attention (native families pass them to Lockstep's: "
                "serve it with model_impl='auto' where one exists)")
    if not call.q_dim == call.k_dim == call.v_dim:
        return f"query, key and value head dims differ ({call.q_dim}, {call.k_dim}, {call.v_dim})"
    if call.kv_heads == 0 or call.q_heads % call.kv_heads:
        return f"{call.q_heads} query heads do not group over {call.kv_heads} KV heads"
    return None


def check_probe(config: Any, probe: Probe) -> LayerCall:
    """Refuse what the probe forward shows; returns layer 0's call, which every layer's matches in head counts and
    head dim (the KV cache's shape)."""
    kind, layers = config.model_type, config.num_hidden_layers
    if probe.unindexed:
        raise ModelRefused(kind, probe.unindexed[0], "an attention module without a layer_idx (the pages are read "
                                                     "and written by layer index)")
    for i in range(layers):
        calls = probe.calls.get(i, [])
        if len(calls) != 1:
            why = ("its attention never reached the attention function (not an attention layer, such as linear "
                   "attention or a state-space block, or modelling code that bypasses transformers' "
                   "AttentionInterface)") if not calls else f"{len(calls)} attention calls in one layer"
            raise ModelRefused(kind, f"layer {i}", why)
        if (why := _layer_refusal(calls[0])) is not None:
            raise ModelRefused(kind, f"layer {i}", why)
    extra = sorted(set(probe.calls) - set(range(layers)))
    if extra:
        raise ModelRefused(kind, f"layer {extra[0]}", f"an attention layer index past num_hidden_layers={layers}")
    first = probe.calls[0][0]
    for i in range(1, layers):
        c = probe.calls[i][0]
        if (c.kv_heads, c.k_dim) != (first.kv_heads, first.k_dim):
            raise ModelRefused(kind, f"layer {i}", f"{c.kv_heads} KV heads of {c.k_dim} where layer 0 has "
                                                   f"{first.kv_heads} of {first.k_dim} (one page layout for all)")
    return first
