"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`): the model's log-softmax at every
prompt position, computed on rank 0 from the logits the ranks gathered during prefill.

A request that asks for them sets the plan's SCORE_ALL flag on each of its rows whose query holds a prompt position
whose next token is a prompt token (cluster.plan.logits_rows): the runner returns those positions' logits after the
sampled rows', gathered over the TP shards as sampling logits are. Position j scores prompt token j + 1; the first
prompt token has no logprob (None). The logprobs are the raw model's (no temperature, penalty or filter), whatever
the request's sampling. Chunked prefill scores each chunk as it runs; a request with prompt logprobs never takes
cached prefix pages (BlockManager.match_prefix), so every prompt position is computed, and a recomputation after
a preemption writes the same positions again. Only serial steps score (the engine runs a step with scored rows
in series: one host transfer, after the forward), so the decode path and overlapped steps are unchanged."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from cluster.device_lists import on_device
from driver.engine.request import Request

TopPairs = tuple[tuple[int, float], ...]


class PromptScore(NamedTuple):
    """One prompt token's logprob and the k most probable tokens at its position, (token, logprob), best first."""

    logprob: float
    top: TopPairs


def scored_rows(wants: np.ndarray, start: np.ndarray, prompt_len: np.ndarray) -> np.ndarray:
    """Which rows of a step score: the request asks for prompt logprobs and the query starts before its prompt's
    last position (a later position predicts no prompt token)."""
    return wants & (start < prompt_len - 1)


def score_prompts(logits: torch.Tensor, reqs: list[Request], start: np.ndarray, stop: np.ndarray) -> None:
    """Record the prompt logprobs of a step's scored rows on their requests. `logits` [sum of the rows' query
    lengths, vocab] float32 on rank 0, every position of each row in row order; `start`/`stop` each row's first
    position and the context after the step. Waits for the device (a serial step's forward is done)."""
    positions, targets, owners = [], [], []
    first = 0  # the row's first position among `logits`' rows
    for req, a, b in zip(reqs, start.tolist(), stop.tolist()):
        if req.prompt_scores is None:
            req.prompt_scores = [None] * len(req.prompt_ids)
        end = min(b, len(req.prompt_ids) - 1)  # positions a..end-1 predict prompt tokens a+1..end
        positions.extend(range(first, first + max(0, end - a)))
        targets.extend(req.prompt_ids[a + 1:end + 1])
        owners.extend([(req, j + 1) for j in range(a, end)])
        first += b - a
    if not owners:
        return
    # log p = logit - logsumexp(logits), read where needed: no [positions, vocab] log-softmax and no copy of the
    # scored positions' logits is made (a row's last position, which predicts no prompt token, is reduced with the
    # others and dropped from the [positions] results): the projection is the one cost scoring adds to a prefill
    rows = on_device(positions, torch.int64, logits.device)
    norm = torch.logsumexp(logits, dim=-1).index_select(0, rows)
    chosen = (logits[rows, on_device(targets, torch.int64, logits.device)] - norm).tolist()
    k = max(min(req.prompt_logprobs or 0, logits.shape[-1]) for req in reqs)
    if k:
        top_values, top_ids = logits.topk(k, dim=-1)
        top_values, top_ids = top_values.index_select(0, rows), top_ids.index_select(0, rows)
    else:
        top_values, top_ids = logits[:0, :0].new_empty(len(positions), 0), rows.new_empty(len(positions), 0)
    values, ids = (top_values - norm[:, None]).tolist(), top_ids.tolist()
    for n, ((req, at), lp) in enumerate(zip(owners, chosen)):
        want = req.prompt_logprobs or 0
        req.prompt_scores[at] = PromptScore(lp, tuple(zip(ids[n][:want], values[n][:want])))
