"""Checkpoint loading: each rank reads only its own slices of the safetensors files (`get_slice(name)[a:b]`
reads just those rows or columns of the memory-mapped file), so its I/O and memory scale with its shard.

Two phases: `stage_*` reads and checks everything (names, shapes, readable bytes) into new tensors without
touching the model; `apply` copies them into the existing parameter storage (so captured graphs stay valid).
At start-up they run back to back; a hot update agrees across ranks in between."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open

from worker.model import CausalLM

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


def stage_one(model: CausalLM, name: str, src: Any, where: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(parameter storage, a copy of this rank's shard of `src`) for one named tensor, checked; None when the
    name is not one of the model's. Only the shard is copied (a pushed bucket's buffer is reused after)."""
    tgt = model.target(name)
    if tgt is None:
        return None
    layer, part, kind = tgt
    try:
        dst, value = layer.shard_of(part, kind, src)
    except ValueError as e:
        raise ValueError(f"{where}: tensor {name}: {e}") from None
    if value.shape != dst.shape:
        raise ValueError(f"{where}: tensor {name}: shard shape {list(value.shape)}, expected {list(dst.shape)}")
    if value.is_floating_point() != dst.is_floating_point():
        raise ValueError(f"{where}: tensor {name}: dtype {value.dtype} cannot replace {dst.dtype}")
    return dst, value.to(dst.dtype, copy=True)


def stage_named(model: CausalLM, tensors: Iterable[tuple[str, Any]], where: str) -> Staged:
    """This rank's shard of every named tensor (safetensors slices or full tensors), checked, as copies."""
    staged: Staged = []
    found: set[str] = set()
    for name, src in tensors:
        one = stage_one(model, name, src, where)
        if one is not None:
            staged.append(one)
            found.add(name)
    missing = model.expected_tensors() - found
    if missing:
        raise ValueError(f"{where} lacks {len(missing)} tensor(s), e.g. {sorted(missing)[:3]}")
    return staged


def stage_checkpoint(model: CausalLM, model_dir: str | os.PathLike) -> Staged:
    """Read and check this rank's slices of a checkpoint directory; the model is not touched."""
    handles = [safe_open(str(path), framework="pt") for path in checkpoint_files(model_dir)]
    try:
        pairs = ((name, f.get_slice(name)) for f in handles for name in f.keys())
        return stage_named(model, pairs, f"checkpoint {model_dir}")
    finally:
        handles.clear()


@torch.no_grad()
def apply(staged: Staged) -> None:
    """Copy staged values into the parameters' existing storage."""
    for dst, value in staged:
        dst.copy_(value)


def load_weights(model: CausalLM, model_dir: str | os.PathLike) -> None:
    """Fill every parameter of this rank's shard from the checkpoint, or raise naming what is wrong."""
    apply(stage_checkpoint(model, model_dir))
