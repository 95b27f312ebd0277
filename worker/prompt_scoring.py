"""Prompt logprobs scored where the logits are: on the vocabulary shards, a chunk of positions at a time, with no
[positions, vocabulary] logits kept and none gathered (driver/engine/prompt_scores.py says what is scored).

Each rank projects CHUNK_ROWS of the SCORE_PROMPT positions' head inputs through its LM head shard (and the
family's post-processing: `CausalLM.project`), reduces the chunk's float32 logits over its real vocabulary columns
(the last shard's padding never counts) to four things per position, and drops them: the log-normaliser
(logsumexp), the logit of the token the position is scored against (-inf when another shard holds it), and the k
largest logits with their global token ids. Rank 0 gathers those few numbers and combines them: the logsumexp of
the ranks' logsumexps, the one finite target logit, and the top k of the ranks' top k. Equal logits rank by the
lowest token id, here and within a shard (also where the tie crosses the k-th place), so the result is the same at
any TP whatever order torch's top-k leaves ties in."""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from cluster.dist import DRIVER
from cluster.plan import StepPlan, logits_rows
from worker.layers import ParallelLMHead

# positions projected and reduced at a time: their logits stay in cache between the projection and the reduction
CHUNK_ROWS = 128


class PromptLogprobs(NamedTuple):
    """Rank 0's scores of every SCORE_PROMPT position (each such row's positions, in row order): `chosen` [N] float32
    the logprob of the token the position is scored against (-inf where it has none), `top_values` [N, k] float32
    the k largest logprobs, largest first (equal ones by lowest id), `top_ids` [N, k] int64 their tokens."""

    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor


class ScoredLogits(NamedTuple):
    """A step with SCORE_PROMPT rows, on rank 0: the gathered logits of its sampled and SCORE_ALL rows (as a step
    without them returns) and its prompt scores."""

    logits: torch.Tensor
    scores: PromptLogprobs


def score_targets(plan: StepPlan) -> np.ndarray:
    """[positions of the plan's SCORE_PROMPT rows, in row order] int64: the token each is scored against, the row's
    next input id, and for its last position the plan's `score_next`; -1 (any negative id) for none."""
    cu = np.concatenate([[0], np.cumsum(plan.q_lens, dtype=np.int64)])
    rows = logits_rows(plan.sample, plan.q_lens)[2].tolist()
    if len(rows) != plan.score_next.shape[0]:
        raise ValueError(f"a plan of {len(rows)} SCORE_PROMPT rows carries {plan.score_next.shape[0]} next tokens")
    parts = [np.append(plan.input_ids[cu[r] + 1:cu[r + 1]], nxt) for r, nxt in zip(rows, plan.score_next.tolist())]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def ranked(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (value, id) pairs [N, m] ordered largest value first, equal values by lowest id (ids distinct)."""
    by_id = ids.argsort(dim=-1)
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    by_value = values.argsort(dim=-1, descending=True, stable=True)
    return values.gather(1, by_value), ids.gather(1, by_value)


def shard_top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of `logits` [N, cols] and their columns [N, k], ranked (`ranked`); when a row's k-th
    and (k + 1)-th largest are equal the tie decides which columns are in, so that row is sorted whole. Rows of
    fewer than k columns are padded with -inf at columns cols, cols + 1, ... (after any real column)."""
    n, cols = logits.shape
    if k == 0:
        return logits.new_empty(n, 0), torch.empty(n, 0, dtype=torch.int64, device=logits.device)
    if k >= cols:
        values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
        pad = torch.arange(cols, k, device=logits.device).expand(n, k - cols)
        return (torch.cat([values, values.new_full((n, k - cols), float("-inf"))], 1), torch.cat([ids, pad], 1))
    values, ids = logits.topk(k + 1, dim=-1)
    tied = torch.nonzero(values[:, k - 1] == values[:, k])[:, 0]
    values, ids = ranked(values[:, :k], ids[:, :k])
    if tied.numel():  # rare with real logits: the whole row, stable-sorted, has the lowest columns of the tie first
        whole, cols_of = torch.sort(logits.index_select(0, tied), dim=-1, descending=True, stable=True)
        values[tied], ids[tied] = whole[:, :k], cols_of[:, :k]
    return values, ids


def reduce_chunk(logits: torch.Tensor, targets: torch.Tensor, start: int, vocab_size: int, k: int) -> torch.Tensor:
    """One rank's reduction of a chunk of float32 logits [C, real columns of its shard] (token ids from `start`):
    [C, 2 + 2k] float64, each row (logsumexp, target logit or -inf, k largest logits, their token ids: padding's
    from `vocab_size` on); float64 holds the float32 values and any token id exactly."""
    cols = logits.shape[-1]
    norm = torch.logsumexp(logits, dim=-1)
    at = targets - start
    mine = (at >= 0) & (at < cols)
    chosen = logits.gather(1, at.clamp(0, cols - 1)[:, None])[:, 0].masked_fill(~mine, float("-inf"))
    values, ids = shard_top(logits, k)
    ids = torch.where(ids < cols, ids + start, ids + vocab_size)
    return torch.cat([norm[:, None].double(), chosen[:, None].double(), values.double(), ids.double()], 1)


def combine(parts: torch.Tensor, k: int) -> PromptLogprobs:
    """Rank 0's scores from every rank's reductions `parts` [ranks, N, 2 + 2k] (ranks in token id order): the
    log-normaliser is the logsumexp of the ranks', the target's logit the one rank's that holds it, the top k the
    top k of the ranks' (a shard's padding, ids past the vocabulary at -inf, ranks after every real token)."""
    ranks, n = parts.shape[0], parts.shape[1]
    norm = torch.logsumexp(parts[:, :, 0], dim=0)
    chosen = parts[:, :, 1].max(dim=0).values  # -inf on every rank but the holder's (a NaN propagates)
    values = parts[:, :, 2:2 + k].transpose(0, 1).reshape(n, ranks * k)
    ids = parts[:, :, 2 + k:].transpose(0, 1).reshape(n, ranks * k).long()
    values, ids = ranked(values, ids)
    return PromptLogprobs((chosen - norm).float(), (values[:, :k] - norm[:, None]).float(), ids[:, :k])


def score_on_shards(project: Callable[[torch.Tensor], torch.Tensor], head: ParallelLMHead, heads: torch.Tensor,
                    targets: torch.Tensor, k: int) -> PromptLogprobs | None:
    """The SCORE_PROMPT positions' scores on rank 0 (None elsewhere) from this rank's head inputs `heads` [N, hidden]
    (`project` turns rows of them into its logits shard), `targets` [N] (score_targets) and the top-k's k. Every
    rank of the device group calls it with the same N and k, after the step's logits gather: one gather to rank 0
    (`DRIVER`) over the head's group when TP > 1, of [N, 2 + 2k] float64 a rank."""
    shard, n = head.shard, heads.shape[0]
    cols = max(0, min(head.rows, head.vocab_size - head.start))  # this shard's real columns (no padding)
    mine = torch.empty(n, 2 + 2 * k, dtype=torch.float64, device=heads.device)
    if cols == 0:  # a shard wholly past the vocabulary (tiny vocabularies at large TP): nothing of it counts
        mine[:, :2 + k] = float("-inf")
        mine[:, 2 + k:] = float(head.vocab_size)
    for a in range(0, n if cols else 0, CHUNK_ROWS):
        b = min(n, a + CHUNK_ROWS)
        mine[a:b] = reduce_chunk(project(heads[a:b])[:, :cols].float(), targets[a:b], head.start, head.vocab_size, k)
    if shard.size == 1:
        return combine(mine[None], k)
    parts = [torch.empty_like(mine) for _ in range(shard.size)] if shard.rank == DRIVER else None
    dist.gather(mine, parts, dst=DRIVER, group=shard.group)
    return None if parts is None else combine(torch.stack(parts), k)
