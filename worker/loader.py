"""Checkpoint loading: each rank reads only its own slices of the safetensors files.

`safe_open(...).get_slice(name)[a:b]` reads just those rows (or columns) from the memory-mapped file, so a
rank's I/O and memory scale with its shard, not with the whole model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from worker.model import CausalLM


def checkpoint_files(model_dir: str | os.PathLike) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [d / n for n in names]
    else:
        files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {d}")
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"checkpoint files listed but missing: {missing}")
    return files


@torch.no_grad()
def load_weights(model: CausalLM, model_dir: str | os.PathLike) -> None:
    """Fill every parameter of this rank's shard from the checkpoint, or raise naming what is missing."""
    expected = model.expected_tensors()
    found: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tgt = model.target(name)
                if tgt is None:
                    continue
                layer, part, kind = tgt
                layer.load(part, kind, f.get_slice(name))
                found.add(name)
    missing = expected - found
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} tensor(s), e.g. {sorted(missing)[:3]}")
