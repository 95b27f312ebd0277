"""Routers: each token's experts and their weights, [T, k] each. Replicated on every rank (a few kB), so every rank
routes alike and the experts' placement needs no exchange of routing decisions.

- `SoftmaxTopK`: softmax over the router logits, top-k, renormalised when asked (Qwen3-MoE's `norm_topk_prob`;
  Mixtral always);
- `GroupLimitedSigmoid`: DeepSeek-V3's (GLM-4.5's): sigmoid scores, plus `e_score_correction_bias` for the
  choice only; experts in `n_group` groups, a group scored by its best two, the best `topk_group` groups kept,
  top-k among their experts; weights from the uncorrected scores, renormalised when `norm_topk_prob`, times
  `routed_scaling_factor`;
- `BiasedTopKSoftmax`: gpt-oss's: logits with a bias, top-k of the logits, then a softmax over the k chosen.
The first two compute in float32 as transformers does; gpt-oss's in the model's dtype, as transformers' does; all
return float32 weights."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cluster.errors import UnsupportedModel
from worker.layers import expect_shape


class ReplicatedRouter(nn.Module):
    """A router's tensors, whole on every rank: part "" is `weight` [E, H]; part "correction" a bias [E]."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, dtype: torch.dtype):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)

    def tensor(self, part: str) -> nn.Parameter:
        return self.weight if part == "" else self.e_score_correction_bias

    def checkpoint_parts(self) -> list[tuple[str, str]]:
        return [("", "weight")]

    def covered_parts(self, part: str) -> list[str]:
        return [part]

    def view(self, part: str, kind: str) -> torch.Tensor:
        return self.tensor(part).data

    def shard_of(self, part: str, kind: str, src: Any) -> tuple[torch.Tensor, torch.Tensor]:
        dst = self.tensor(part)
        expect_shape(src, tuple(dst.shape))
        return dst.data, src[:]


class SoftmaxTopK(ReplicatedRouter):
    def __init__(self, num_experts: int, hidden: int, top_k: int, renormalise: bool, dtype: torch.dtype):
        super().__init__(num_experts, hidden, top_k, dtype)
        self.renormalise = renormalise

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights


class GroupLimitedSigmoid(ReplicatedRouter):
    def __init__(self, num_experts: int, hidden: int, top_k: int, groups: int, top_groups: int, renormalise: bool,
                 scale: float, dtype: torch.dtype):
        super().__init__(num_experts, hidden, top_k, torch.float32)  # float32 in transformers, whatever the model's
        if num_experts % groups:
            raise UnsupportedModel(f"{num_experts} experts do not split into n_group={groups} groups")
        self.groups, self.top_groups, self.renormalise, self.scale = groups, top_groups, renormalise, scale
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def checkpoint_parts(self) -> list[tuple[str, str]]:
        return [("", "weight"), ("correction", "weight")]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        t, e = choice.shape
        group_scores = choice.view(t, self.groups, e // self.groups).topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, k=self.top_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
        keep = keep.unsqueeze(-1).expand(t, self.groups, e // self.groups).reshape(t, e)
        experts = torch.topk(choice.masked_fill(~keep, float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.renormalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.scale


class BiasedTopKSoftmax(ReplicatedRouter):
    """Part "" is `weight` [E, H] (kind weight) and `bias` [E] (kind bias): the checkpoint's `router.weight` and
    `router.bias`."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, dtype: torch.dtype):
        super().__init__(num_experts, hidden, top_k, dtype)
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=dtype), requires_grad=False)

    def checkpoint_parts(self) -> list[tuple[str, str]]:
        return [("", "weight"), ("", "bias")]

    def view(self, part: str, kind: str) -> torch.Tensor:
        return (self.weight if kind == "weight" else self.bias).data

    def shard_of(self, part: str, kind: str, src: Any) -> tuple[torch.Tensor, torch.Tensor]:
        dst = self.view(part, kind)
        expect_shape(src, tuple(dst.shape))
        return dst, src[:]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, experts = torch.topk(F.linear(x, self.weight, self.bias), self.top_k, dim=-1)
        return experts, torch.softmax(values, dim=-1, dtype=values.dtype).float()
