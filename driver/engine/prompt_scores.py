"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`): the model's log-softmax at every
prompt position, reduced on the vocabulary shards during prefill and recorded on rank 0.

A request that asks for them sets the plan's SCORE_PROMPT flag on each of its rows whose query holds a prompt
position whose next token is a prompt token (`scored_rows`; cluster.plan.logits_rows). Position j scores prompt
token j + 1: the workers keep no request state, so the plan carries, per SCORE_PROMPT row, the token after its
query (`score_next`: the prompt's next token, -1 past the prompt's last position; the other positions' are the
row's next input ids) and the step's largest k (`score_top`). Every rank projects those positions through its LM
head shard a chunk at a time and keeps only each position's logsumexp, target logit and top k; rank 0 gathers
and combines them (worker/prompt_scoring.py), so no [positions, vocab] logits are kept or gathered and the LM
head over the prompt is the one cost scoring adds to a prefill. SCORE_ALL (every position's full logits
gathered) is speculative decoding's verify rows' alone. The first prompt token has no logprob (None). The
logprobs are the raw model's (no temperature, penalty or filter), whatever the request's sampling; equal logprobs
in a top k rank by lowest token id. Chunked prefill scores each chunk as it runs; a request with prompt logprobs
never takes cached prefix pages (BlockManager.match_prefix), so every prompt position is computed, and a
recomputation after a preemption writes the same positions again. Only serial steps score (the engine runs a
step with scored rows in series: one host transfer, after the forward), so the decode path and overlapped steps
are unchanged."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from cluster.device_lists import on_device
from cluster.plan import SCORE_PROMPT, StepPlan
from driver.engine.request import Request
from worker.prompt_scoring import PromptLogprobs, ScoredLogits

TopPairs = tuple[tuple[int, float], ...]


class PromptScore(NamedTuple):
    """One prompt token's logprob and the k most probable tokens at its position, (token, logprob), best first."""

    logprob: float
    top: TopPairs


def scored_rows(wants: np.ndarray, start: np.ndarray, prompt_len: np.ndarray) -> np.ndarray:
    """Which rows of a step score: the request asks for prompt logprobs and the query starts before its prompt's
    last position (a later position predicts no prompt token)."""
    return wants & (start < prompt_len - 1)


def carry_targets(plan: StepPlan, reqs: list[Request], vocab_size: int) -> None:
    """Set what the workers need to score the plan's SCORE_PROMPT rows (`reqs`: the plan's, in row order): each
    row's token after its query (-1: past the prompt's last position) and the step's k (at most `vocab_size`)."""
    rows = np.flatnonzero(plan.sample & SCORE_PROMPT).tolist()
    stops = plan.kv_lens[rows].tolist()
    scored = [reqs[r] for r in rows]
    plan.score_next = np.array([req.prompt_ids[b] if b < len(req.prompt_ids) else -1
                                for req, b in zip(scored, stops)], np.int32)
    plan.score_top = max([min(req.prompt_logprobs or 0, vocab_size) for req in scored], default=0)


def record_scores(out: ScoredLogits, plan: StepPlan, reqs: list[Request]) -> torch.Tensor:
    """Record a serial step's prompt scores on its SCORE_PROMPT rows' requests (`reqs`: the plan's, in row order);
    returns the step's gathered logits (sampled and SCORE_ALL rows)."""
    prompt = (plan.sample & SCORE_PROMPT).astype(bool)
    stop = plan.kv_lens[prompt]
    score_prompts(out.scores, [r for r, m in zip(reqs, prompt.tolist()) if m], stop - plan.q_lens[prompt], stop)
    return out.logits


def score_prompts(scores: PromptLogprobs, reqs: list[Request], start: np.ndarray, stop: np.ndarray) -> None:
    """Record the prompt logprobs of a step's scored rows on their requests. `scores` on rank 0: every position of
    each row in row order (worker/prompt_scoring.py); `start`/`stop` each row's first position and the context
    after the step. Waits for the device (a serial step's forward is done)."""
    positions, owners = [], []
    first = 0  # the row's first position among `scores`' rows
    for req, a, b in zip(reqs, start.tolist(), stop.tolist()):
        if req.prompt_scores is None:
            req.prompt_scores = [None] * len(req.prompt_ids)
        end = min(b, len(req.prompt_ids) - 1)  # positions a..end-1 predict prompt tokens a+1..end
        positions.extend(range(first, first + max(0, end - a)))
        owners.extend([(req, j + 1) for j in range(a, end)])
        first += b - a
    if not owners:
        return
    rows = on_device(positions, torch.int64, scores.chosen.device)  # a row's last position may score nothing
    chosen = scores.chosen.index_select(0, rows).tolist()
    values, ids = scores.top_values.index_select(0, rows).tolist(), scores.top_ids.index_select(0, rows).tolist()
    for n, ((req, at), lp) in enumerate(zip(owners, chosen)):
        want = req.prompt_logprobs or 0
        req.prompt_scores[at] = PromptScore(lp, tuple(zip(ids[n][:want], values[n][:want])))
