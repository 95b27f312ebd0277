"""Greedy tokens chosen where the logits are: on the vocab shards, with no logits gathered (docs/architecture.md,
"Tensor parallelism"). CPU ranks of one host exchange each rank's (largest logit, its token) through the
shared-memory segment of their all-reduce (cluster/host_all_reduce.py, `all_gather`: one exchange, every rank
combines alike); elsewhere a gather to rank 0 and a broadcast rather than one all-gather: on gloo (the CPU's
device group) all-gather and all-reduce of a few KB have latency tails ten times the gather's (measured: p90 3.4
ms against 0.4), and the gather and broadcast together cost 7 % of a TP=2 decode-heavy CPU run (2026-12-04)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from cluster.dist import DRIVER
from cluster.host_all_reduce import HostAllReduce


class ShardArgmax(NamedTuple):
    """Each row's greedy choice: `tokens` [N] int64, the same on every rank; `best` [N] float32 its largest logit
    (NaN when its logits hold one, -inf when every logit is -inf) on rank 0, None elsewhere."""

    best: torch.Tensor | None
    tokens: torch.Tensor


def _combine(both: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(best, token) of each row from every rank's (best, id) pairs `both` [ranks, 2, N], ranks in token id order."""
    best, first = both[:, 0].max(0)  # the first of equal maxima: the lowest rank, so the lowest token id
    return best, both[:, 1].gather(0, first[None])[0].long()


def shard_argmax(local: torch.Tensor, start: int, vocab_size: int, rank: int, size: int, group: Any,
                 host: HostAllReduce | None = None) -> ShardArgmax:
    """The rows' greedy tokens from this rank's logits shard `local` [N, rows] (token ids start..start + rows,
    those from `vocab_size` on padding). Every rank of the device group (`rank` of `size`) calls it, same N, with
    the group's host all-reduce (`host`) or None alike."""
    valid = max(0, min(local.shape[-1], vocab_size - start))
    if valid:
        best, ids = local[:, :valid].float().max(-1)  # max propagates a NaN, as the sampler's check expects
        ids += start
    else:  # a shard wholly past the vocabulary (tiny vocabularies at large TP)
        best = torch.full(local.shape[:1], float("-inf"), device=local.device)
        ids = torch.full(local.shape[:1], start, dtype=torch.int64, device=local.device)
    if size == 1:
        return ShardArgmax(best, ids)
    mine = torch.stack([best.double(), ids.double()])  # float64 holds any token id exactly
    both = host.all_gather(mine) if host is not None and mine.device.type == "cpu" else None
    if both is not None:  # every rank holds every rank's pairs and combines them alike
        best, ids = _combine(both)
        return ShardArgmax(best.float() if rank == 0 else None, ids)
    parts = [torch.empty_like(mine) for _ in range(size)] if rank == 0 else None
    dist.gather(mine, parts, dst=DRIVER, group=group)
    if parts is not None:
        best, ids = _combine(torch.stack(parts))
    dist.broadcast(ids, DRIVER, group=group)
    return ShardArgmax(best.float() if rank == 0 else None, ids)
