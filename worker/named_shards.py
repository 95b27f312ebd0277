"""This rank's shard of every checkpoint tensor, under transformers' names, as views into the live parameters.

Lockstep fuses q/k/v and gate/up, splits tensors across ranks and pads the last vocabulary shard with zero
rows; a script written for transformers sees none of that: each checkpoint name (`CausalLM.expected_tensors()`,
plus a tied model's `lm_head.weight` in `state_dict`) maps to a view sharing storage with the parameter the
forward reads, so an in-place change (`p.copy_(x)`, `p.mul_(2)`) is what the next step computes with:

| transformers name | this rank's view |
|---|---|
| `...self_attn.{q,k,v}_proj.*` | its heads' rows of the fused `qkv_proj` (KV heads replicated past their count) |
| `...mlp.{gate,up}_proj.*` | rows `[rank * n, (rank + 1) * n)` of `intermediate_size` in the fused `gate_up_proj` |
| `...self_attn.o_proj.weight`, `...mlp.down_proj.weight` | columns `[rank * c, (rank + 1) * c)` (their biases whole) |
| `model.embed_tokens.weight`, `lm_head.weight` | vocabulary rows `[rank * r, rank * r + n)`, n <= r (no padding) |
| norms (`*_layernorm.weight`, `model.norm.weight`, `q_norm`, `k_norm`) | the whole tensor (replicated on every rank) |

`shard_of(model, name, full)` cuts exactly that view's values out of a full (unsharded) tensor. Assigning
`p.data = other` rebinds the view, not the storage, and changes nothing the forward reads."""

from __future__ import annotations

from typing import Any

import torch

from worker.checkpoint_names import Target
from worker.models.decoder import CausalLM

LM_HEAD = "lm_head.weight"


def _target(model: CausalLM, name: str) -> Target:
    own = model.embed_name if name == LM_HEAD and model.tied else name  # a tied head's tensor is the embedding's
    tgt = model.target(own)
    if tgt is None or tgt.covers != (own,):
        raise KeyError(f"{name!r} is not a tensor of this model")
    return tgt


def shard_view(model: CausalLM, name: str) -> torch.Tensor:
    """The view of this rank's shard of checkpoint tensor `name`, sharing the live parameter's storage."""
    tgt = _target(model, name)
    return tgt.layer.view(tgt.part, tgt.kind)


def named_shards(model: CausalLM, with_tied: bool = False) -> dict[str, torch.Tensor]:
    """Every checkpoint name -> this rank's view, in the model's layer order. `with_tied` adds
    `lm_head.weight` of a tied model (the same view as the embedding), as transformers' state_dict does."""
    names = sorted(model.expected_tensors(), key=_order)
    if with_tied and model.tied:
        names.append(LM_HEAD)
    return {name: shard_view(model, name) for name in names}


def shard_of(model: CausalLM, name: str, full: Any) -> torch.Tensor:
    """This rank's part of a full tensor `name` (transformers' shape), shaped like `shard_view(model, name)`."""
    tgt = _target(model, name)
    _, value = tgt.layer.shard_of(tgt.part, tgt.kind, full)
    return value[:shard_view(model, name).shape[0]]


def _order(name: str) -> tuple:
    parts = name.split(".")
    if parts[0] == "lm_head":
        return (3,)
    if parts[1] == "layers":
        return (1, int(parts[2]), ".".join(parts[3:]))
    return (0 if parts[1] == "embed_tokens" else 2, name)
