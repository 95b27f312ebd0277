"""The generic path's checkpoint names: every tensor is named as transformers' own `state_dict` names it (the names
`save_pretrained` writes), and loads into the module transformers holds it in. Lockstep's layers (sharded linears,
embedding, head) load their shard (`shard_of`); every other parameter or persistent buffer (norms, q/k norms, scales)
is replicated, whole on every rank (`Whole`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.checkpoint_names import Target
from worker.layers import expect_shape


class Whole:
    """A parameter or buffer every rank holds whole: loaded and updated as one tensor of its own shape."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def shard_of(self, part: str, kind: str, src: Any) -> tuple[torch.Tensor, torch.Tensor]:
        expect_shape(src, tuple(self.tensor.shape))
        return self.tensor.data, src[:]

    def view(self, part: str, kind: str) -> torch.Tensor:
        return self.tensor.data


def tensor_targets(hf: nn.Module, head: nn.Module | None) -> dict[str, Target]:
    """Checkpoint name -> what loads it, for every tensor a complete checkpoint holds; `head`: a tied LM head, left
    out (its weight is the embedding's)."""
    targets: dict[str, Target] = {}
    seen: set[int] = set()
    for path, module in hf.named_modules():
        if module is head:
            continue
        prefix = f"{path}." if path else ""
        if hasattr(module, "checkpoint_parts"):  # Lockstep's layers: whole checkpoint tensors, this rank's shard
            for part, kind in module.checkpoint_parts():
                targets[prefix + kind] = Target(module, part, kind, (prefix + kind,))
                seen.add(id(getattr(module, kind)))
            continue
        own = [*module.named_parameters(recurse=False),
               *((n, b) for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set)]
        for name, tensor in own:
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                targets[prefix + name] = Target(Whole(tensor), "", name, (prefix + name,))
    return targets
