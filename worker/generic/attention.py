"""Lockstep's paged attention as a transformers attention function (`AttentionInterface`), for the generic path.

transformers' attention modules project and rotate q, k and v with their own code, then call the function registered
under the model's `_attn_implementation` with (module, query [1, Hq, T, D], key and value [1, Hkv, T, D], mask,
scaling, dropout, sliding_window, **kwargs). Registered as ATTN_NAME, this one writes the step's keys and values into
Lockstep's pages of layer `module.layer_idx` and runs the paged attention of worker/attention.py over them; the step
(its AttnMeta and every layer's cache) arrives through the forward's kwargs as `lockstep_step`, which transformers
hands from the model's forward down to the attention function, as its own continuous batching passes its cache
metadata. Modelling code that drops those kwargs on the way (StableLM's decoder layer, older models) gets the step
from `HELD` instead, which the forward sets around the call (the probe finds out which a model needs). No mask
function is registered under the name, so transformers builds no mask (the pages' positions are the mask) and
passes None.

At load the model runs one forward of two tokens with a `Probe` in place of the step: it records what each layer
hands over (head counts, head dims, window, mask, softcap, sinks), which sizes the KV cache and is checked for what
the path cannot serve (worker/generic/refusals.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.attention import AttnMeta, StepMasks, paged_attention, step_masks, write_kv

ATTN_NAME = "lockstep_paged"
STEP_KWARG = "lockstep_step"


@dataclass
class GenericStep:
    """One forward's attention inputs: the step's metadata, every layer's K and V pages, and the decode masks, made
    on first use for each window size and shared by every layer of that window."""

    meta: AttnMeta
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    masks: StepMasks = field(default_factory=dict)


@dataclass(frozen=True)
class LayerCall:
    """What one layer handed to the attention function in the probe."""

    module: str  # the attention module's class name
    q_heads: int
    kv_heads: int
    q_dim: int
    k_dim: int
    v_dim: int
    q_len: int
    kv_len: int
    window: int | None
    masked: bool  # the model passed an attention mask of its own
    causal: bool  # the module's `is_causal` (True when it has none)
    softcap: float | None
    sinks: bool  # the module has attention sinks (`sinks`, or an `s_aux` argument)


@dataclass
class Probe:
    """Stands in for the step in the load-time forward: records each layer's call (by layer index) and returns
    zeros of the output's shape."""

    calls: dict[int, list[LayerCall]] = field(default_factory=dict)
    unindexed: list[str] = field(default_factory=list)  # attention modules without a `layer_idx`

    def record(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: Any, window: int | None, kwargs: dict[str, Any]) -> torch.Tensor:
        call = LayerCall(type(module).__name__, query.shape[1], key.shape[1], query.shape[-1], key.shape[-1],
                         value.shape[-1], query.shape[2], key.shape[2], window, mask is not None,
                         bool(getattr(module, "is_causal", True)), kwargs.get("softcap"),
                         getattr(module, "sinks", None) is not None or kwargs.get("s_aux") is not None)
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            self.unindexed.append(call.module)
        else:
            self.calls.setdefault(int(layer), []).append(call)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


class NoStep(RuntimeError):
    """An attention module was called with no step: neither in its kwargs nor held."""


class Held(threading.local):
    """The step of the forward in progress on this thread, for modelling code that does not pass kwargs down to its
    attention (a thread's own: ranks that share a process, as a launcher's threads may, each hold their own)."""

    step: GenericStep | Probe | None = None


HELD = Held()


def lockstep_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                       sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The function transformers calls for every attention layer: q [1, Hq, T, D], k and v [1, Hkv, T, D] of the
    step's tokens -> ([1, T, Hq, D], None). Every rank calls it alike (no collective here)."""
    step = kwargs.get(STEP_KWARG) or HELD.step
    if isinstance(step, Probe):
        return step.record(module, query, key, value, attention_mask, sliding_window, kwargs), None
    if step is None:
        raise NoStep(f"{type(module).__name__} reached Lockstep's attention with no step: only Lockstep's generic "
                     f"forward calls it")
    layer = module.layer_idx
    k_cache, v_cache = step.k_caches[layer], step.v_caches[layer]
    write_kv(k_cache, v_cache, key[0].transpose(0, 1), value[0].transpose(0, 1), step.meta)
    q = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
    if sliding_window not in step.masks:
        step.masks.update(step_masks(step.meta, [sliding_window], q.dtype))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = paged_attention(q, k_cache, v_cache, step.meta, sliding_window, scale, step.masks)
    return out.unsqueeze(0), None


def register() -> None:
    """Make ATTN_NAME a transformers attention implementation (idempotent; process-wide, as transformers' own)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, lockstep_attention)
