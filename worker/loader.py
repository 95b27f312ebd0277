"""Checkpoint loading: each rank reads only its own slices of the safetensors files (views into the memory-mapped
files: only the pages of its rows or columns are touched), so its I/O and memory scale with its shard.

Two phases: `stage_*` checks everything (names, shapes, that the bytes are there) and holds this rank's values
(views of a mapped checkpoint or of a trainer's shared buckets, or copies of pushed buckets) without touching the
model; `apply` copies them into the existing parameter storage (so captured graphs stay valid).
At start-up they run back to back; a hot update agrees across ranks in between."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import torch

from cluster.errors import Code, WeightRefused
from worker.mapped_checkpoint import mapped_checkpoint
from worker.models.decoder import CausalLM
from worker.packed_linear import weights_changed

Staged = list[tuple[torch.Tensor, torch.Tensor]]  # (parameter storage, new values)


def checkpoint_files(model_dir: str | os.PathLike) -> list[Path]:
    d = Path(model_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"no checkpoint directory {d}")
    index = d / "model.safetensors.index.json"
    if index.exists():
        files = [d / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {d}")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"checkpoint files listed but missing: {missing}")
    return files


def is_tied_head(model: CausalLM, name: str) -> bool:
    """A tied model's `lm_head.weight`: transformers' state_dict has it, the embedding's update covers it."""
    return name == "lm_head.weight" and model.tied


def stage_one(model: CausalLM, name: str, src: Any, where: str, copy: bool = True,
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(parameter storage, this rank's shard of `src`) for one named tensor, checked; None when the name is not
    one of the model's (`CausalLM.target`: its family's name table, published or fused layout). `copy`: the shard is a copy (a pushed bucket's buffer is reused after); False keeps a
    view of `src` where the dtypes agree (a handle's shared memory, valid until the update is applied).
    Raises WeightRefused (shape_mismatch) naming the tensor."""
    tgt = model.target(name)
    if tgt is None:
        return None
    try:
        dst, value = tgt.layer.shard_of(tgt.part, tgt.kind, src)
    except ValueError as e:
        raise WeightRefused(f"{where}: tensor {name}: {e}", Code.SHAPE_MISMATCH, tensor=name) from None
    if value.shape != dst.shape:
        raise WeightRefused(f"{where}: tensor {name}: shard shape {list(value.shape)}, expected {list(dst.shape)}",
                            Code.SHAPE_MISMATCH, tensor=name)
    if value.is_floating_point() != dst.is_floating_point():
        raise WeightRefused(f"{where}: tensor {name}: dtype {value.dtype} cannot replace {dst.dtype}",
                            Code.SHAPE_MISMATCH, tensor=name)
    return dst, value.to(dst.dtype, copy=copy)


def stage_named(model: CausalLM, tensors: Iterable[tuple[str, Any]], where: str, partial: bool = False,
                copy: bool = True) -> Staged:
    """This rank's shard of every named tensor (safetensors slices or full tensors), checked. Full (the default):
    every tensor of the model must be there (names it does not have are ignored, as at loading). `partial`: any
    subset, but every name must be the model's. Refusals are WeightRefused naming the tensor: missing_tensor,
    unknown_tensor, shape_mismatch."""
    staged: Staged = []
    found: set[str] = set()
    for name, src in tensors:
        one = stage_one(model, name, src, where, copy)
        if one is not None:
            staged.append(one)
            found.update(model.target(name).covers)  # a fused alias fills every name it stands for
        elif partial and not is_tied_head(model, name):
            raise WeightRefused(f"{where}: tensor {name}: the model has no tensor of this name",
                                Code.UNKNOWN_TENSOR, tensor=name)
    missing = set() if partial else model.expected_tensors() - found
    if missing:
        first = sorted(missing)[0]
        raise WeightRefused(f"{where} lacks {len(missing)} tensor(s), e.g. {sorted(missing)[:3]} (partial=True "
                            f"updates a subset)", Code.MISSING_TENSOR, tensor=first)
    return staged


def stage_checkpoint(model: CausalLM, model_dir: str | os.PathLike, partial: bool = False) -> Staged:
    """Check this rank's slices of a checkpoint directory (`partial`: it may hold a subset of the model's tensors,
    each of them the model's) and stage them as views into the mapped files (worker/mapped_checkpoint.py): `apply`
    copies each byte once, straight from the page cache; the model is not touched here."""
    pairs = mapped_checkpoint(checkpoint_files(model_dir))
    return stage_named(model, pairs, f"checkpoint {model_dir}", partial, copy=False)


@torch.no_grad()
def apply(staged: Staged) -> None:
    """Copy staged values into the parameters' existing storage."""
    for dst, value in staged:
        dst.copy_(value)
    weights_changed()  # decode products' packed copies (worker/packed_linear.py) are made again


def load_weights(model: CausalLM, model_dir: str | os.PathLike) -> None:
    """Fill every parameter of this rank's shard from the checkpoint, or raise naming what is wrong."""
    apply(stage_checkpoint(model, model_dir))
