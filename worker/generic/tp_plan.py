"""transformers' tensor-parallel plan (`config.base_model_tp_plan`: {"layers.*.self_attn.q_proj": "colwise", ...})
carried out with Lockstep's sharded linears instead of DTensors: every `nn.Linear` of the decoder is replaced, the
plan's by the style's class (worker/generic/sharded.py), the others by a replicated one (every rank holds the whole
weight). The styles and what each becomes:

| style | Lockstep's layer | collective |
|---|---|---|
| `colwise` | `ColumnShard`: this rank's rows (whole heads under an attention module) | none |
| `colwise_gather_output`, `colwise_rep` | `GatheredColumn`: this rank's rows, then the whole output | one all-reduce |
| `rowwise` | `RowShard`: this rank's input columns | one all-reduce |
| `rowwise_split_input`, `rowwise_rep` | `SplitInputRow`: the input whole, its own columns taken | one all-reduce |
| `replicated_with_grad_allreduce`, `replicate` | replicated: whole on every rank | none |
| `embedding_rowwise` | the vocab-parallel embedding Lockstep always uses | one all-reduce |

Any other style (`packed_colwise`, `sequence_parallel`, `moe_tp_experts`, ...) is refused at load, naming the layer
it is for, as is a style on a module that is not a linear, and a split that does not divide."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from cluster.errors import ModelRefused
from worker.generic.sharded import ColumnShard, GatheredColumn, RowShard, SplitInputRow
from worker.layers import Shard

COLWISE, GATHERED = ("colwise",), ("colwise_gather_output", "colwise_rep")
ROWWISE, SPLIT_INPUT = ("rowwise",), ("rowwise_split_input", "rowwise_rep")
AS_IS = ("replicated_with_grad_allreduce", "replicate", "embedding_rowwise")
KNOWN = COLWISE + GATHERED + ROWWISE + SPLIT_INPUT + AS_IS


def plan_pattern(path: str) -> str:
    """A module path in the plan's spelling: layer indices become `*` (`layers.3.mlp` -> `layers.*.mlp`)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", path)


def base_plan(config: Any) -> dict[str, str]:
    return dict(getattr(config, "base_model_tp_plan", None) or {})


def styles(hf: nn.Module, config: Any) -> dict[str, str]:
    """Module or parameter path (as transformers names it) -> its plan style, for everything the plan names here."""
    plan, prefix = base_plan(config), getattr(hf, "base_model_prefix", "model")
    found = {}
    names = [n for n, _ in hf.named_modules()] + [n for n, _ in hf.named_parameters()]
    for path in names:
        rel = path[len(prefix) + 1:] if path.startswith(prefix + ".") else path
        style = plan.get(plan_pattern(rel))
        if style is not None:
            found[path] = style
    return found


def _head_dim(hf: nn.Module, path: str) -> int | None:
    """The head dim of the attention module above `path`, if it has one."""
    parent = hf.get_submodule(path.rpartition(".")[0]) if "." in path else hf
    return getattr(parent, "head_dim", None)


def _sharded(path: str, linear: nn.Linear, style: str, shard: Shard, dtype: torch.dtype, model_type: str,
             head_dim: int | None) -> nn.Module:
    """The Lockstep layer standing for `linear` under `style` (None: replicated) on this rank."""
    out, inp, bias, tp = linear.out_features, linear.in_features, linear.bias is not None, shard.size
    if style is None or style in AS_IS:
        return ColumnShard(inp, out, 0, out, bias, dtype)
    split, what = (out, "rows") if style in COLWISE + GATHERED else (inp, "columns")
    if split % tp:
        raise ModelRefused(model_type, path, f"{split} {what} do not split over tp={tp} ranks ({style!r})")
    if style in COLWISE and head_dim and (out // head_dim) % tp:
        raise ModelRefused(model_type, path, f"{out // head_dim} heads of {head_dim} do not split over tp={tp} ranks "
                                             f"('colwise'; the generic path does not replicate heads)")
    rows = out // tp
    if style in COLWISE:
        return ColumnShard(inp, rows, shard.rank * rows, out, bias, dtype)
    if style in GATHERED:
        return GatheredColumn(inp, rows, shard.rank * rows, out, bias, dtype, shard)
    return (RowShard if style in ROWWISE else SplitInputRow)(inp, out, bias, shard, dtype)


def check_styles(hf: nn.Module, config: Any, model_type: str) -> dict[str, str]:
    """The plan's styles on this model, after refusing an unknown style or a sharding style on a non-linear."""
    found = styles(hf, config)
    for path, style in found.items():
        if style not in KNOWN:
            raise ModelRefused(model_type, path, f"tensor-parallel style {style!r} is not one the generic path "
                                                 f"knows ({', '.join(KNOWN)})")
        module = _module_or_none(hf, path)
        if style not in AS_IS and not isinstance(module, nn.Linear):
            what = type(module).__name__ if module is not None else "a parameter"
            raise ModelRefused(model_type, path, f"style {style!r} on {what}, not an nn.Linear")
    return found


def _module_or_none(hf: nn.Module, path: str) -> nn.Module | None:
    try:
        return hf.get_submodule(path)
    except AttributeError:
        return None


def shard_linears(hf: nn.Module, config: Any, shard: Shard, dtype: torch.dtype, device: torch.device) -> dict[str, str]:
    """Replace every nn.Linear of `hf` by Lockstep's layer for its style at this rank;
    returns path -> style of the sharded ones ("replicated" for the rest). At TP=1 the plan is not consulted."""
    model_type = config.model_type
    found = check_styles(hf, config, model_type) if shard.size > 1 else {}
    applied = {}
    for path, module in list(hf.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        style = found.get(path)
        with torch.device(device):
            hf.set_submodule(path, _sharded(path, module, style, shard, dtype, model_type, _head_dim(hf, path)))
        applied[path] = style or "replicated"
    return applied
