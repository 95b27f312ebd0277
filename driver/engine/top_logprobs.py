"""Each token's most probable alternatives with their logprobs (OpenAI's `top_logprobs`, 1..20), for the rows that
ask: the top-k of the row's log-softmax of its processed logits (the same distribution as the chosen token's
logprob), computed on the logits' device beside the picks and moved to the host in the same step, never waited on
before `collect`."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Top(NamedTuple):
    """[N, k] logprobs and token ids, k the largest any row asked for (on the device, then on the host)."""

    logprobs: torch.Tensor
    ids: torch.Tensor


def top_of(processed: torch.Tensor, wanted: list[int], norm: torch.Tensor | None = None) -> Top | None:
    """The top-k (k = max(wanted)) of every row's log-softmax, or None when no row asks: logit less `norm` (each
    row's [N, 1]; None: its logsumexp), as the chosen token's logprob is computed, so the chosen token's two figures
    are equal (driver/engine/logprobs_mode.py: a logits mode's norm is 0)."""
    k = max(wanted, default=0)
    if k <= 0:
        return None
    values, ids = torch.topk(processed, min(k, processed.shape[-1]), dim=-1)
    return Top(values - (processed.logsumexp(-1, keepdim=True) if norm is None else norm), ids)


def top_to_host(top: Top | None) -> Top | None:
    """Start the transfer of `top` to the host (pinned, non-blocking on CUDA: the picks' event covers it)."""
    if top is None or top.ids.device.type != "cuda":
        return top
    def pinned(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
    return Top(pinned(top.logprobs), pinned(top.ids))


def top_pairs(top: Top | None, wanted: list[int]) -> list[tuple[tuple[int, float], ...] | None]:
    """Each row's (token, logprob) pairs, most probable first, as many as it asked for (None: it asked none)."""
    if top is None:
        return [None] * len(wanted)
    values, ids = top.logprobs.tolist(), top.ids.tolist()
    return [tuple(zip(ids[i][:k], values[i][:k])) if k > 0 else None for i, k in enumerate(wanted)]
