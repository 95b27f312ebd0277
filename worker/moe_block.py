"""A mixture-of-experts feed-forward block: route, run this rank's experts (and its slice of the shared experts,
if the family has them), then one all-reduce, as a dense MLP's. Also the name rules of its checkpoint tensors in
both layouts: published (one tensor per expert) and transformers' fused (`experts.gate_up_proj`,
`experts.down_proj`, as transformers/conversion_mapping.py makes them and `save_pretrained(...,
save_original_format=False)` or `state_dict()` name them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from worker.checkpoint_names import NameRule, NameTable
from worker.experts import Experts
from worker.gated_mlp import GatedMLP, mlp_names
from worker.layers import Shard
from worker.routers import ReplicatedRouter


class SparseMoE(nn.Module):
    """`routed` [E] int64: the real tokens routed to each expert since the model was made (a (token, choice) pair
    each), added on the device in the forward (no host sync; padding rows add nothing), read by `routed_tokens`.
    The router is replicated, so every rank counts the same routing: one rank's counts are the cluster's."""

    def __init__(self, router: ReplicatedRouter, experts: Experts, shared: GatedMLP | None, shard: Shard):
        super().__init__()
        self.router, self.experts, self.shard = router, experts, shard
        if shared is not None:
            self.shared_experts = shared  # made with reduce=False: summed into the experts' part first
        self.has_shared = shared is not None
        self.register_buffer("routed", torch.zeros(router.weight.shape[0], dtype=torch.int64,
                                                   device=router.weight.device), persistent=False)

    def forward(self, x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """x [T, H]; real [T] bool, False on padding rows. Every rank of the device group calls it (one
        all-reduce)."""
        chosen, weights = self.router(x)
        self.routed.scatter_add_(0, chosen.reshape(-1), real.to(torch.int64).repeat_interleave(chosen.shape[1]))
        y = self.experts(x, chosen, weights)
        if self.has_shared:
            y = y + self.shared_experts(x)
        return self.shard.all_reduce(y)


def routed_tokens(model: nn.Module) -> dict[str, list[int]]:
    """Layer index (as text: the figure travels as JSON and msgpack alike) -> real tokens routed to each of its
    experts since the model was made (a token counts once for each of its top-k choices), for every MoE layer of
    `model` (none: empty). Reads the device counters (one host copy here, none in the forward). Every rank routes
    every token alike (the router is replicated; expert-parallel ranks too), so this rank's counts are already the
    figure summed over the cluster, each token counted once, not once a rank: rank 0 reports them unreduced."""
    return {name.split(".")[1]: block.routed.tolist() for name, block in model.named_modules()
            if isinstance(block, SparseMoE)}


@dataclass(frozen=True)
class ExpertNames:
    """How a family's checkpoint spells its MoE block: `block` under the layer (published), the router's name,
    each expert's gate, up and down projections."""

    block: str = "mlp"
    router: str = "gate"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str = ""  # the shared experts' block under `block` ("shared_experts"), if any
    correction: bool = False  # the router has `e_score_correction_bias`

    def table(self) -> NameTable:
        published = f"model.layers.{{L}}.{self.block}"
        rules = [NameRule(f"{published}.{self.router}.weight", "layers.{L}.mlp.router"),
                 *(NameRule(f"{published}.experts.{{E}}.{proj}.weight", "layers.{L}.mlp.experts", f"{part}.{{E}}")
                   for part, proj in (("gate", self.gate), ("up", self.up), ("down", self.down))),
                 # transformers' in-memory names (its conversion renames the block to `mlp` and fuses experts)
                 NameRule("model.layers.{L}.mlp.experts.gate_up_proj", "layers.{L}.mlp.experts", "gate_up", True),
                 NameRule("model.layers.{L}.mlp.experts.down_proj", "layers.{L}.mlp.experts", "down", True)]
        if self.block != "mlp":
            rules.append(NameRule("model.layers.{L}.mlp.gate.weight", "layers.{L}.mlp.router", alias=True))
        if self.correction:
            rules.append(NameRule(f"{published}.{self.router}.e_score_correction_bias", "layers.{L}.mlp.router",
                                  "correction"))
        table = NameTable(tuple(rules))
        if self.shared:
            table = table + mlp_names(f"{self.block}.{self.shared}")
        return table
