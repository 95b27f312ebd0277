"""The logits processors of a sampling step, for a whole batch at once, on the logits' device, in transformers'
order (generation options: constraint_processors.py). Which rows need a processor is known on the host from the
parameters, so no step waits on the device to decide; a row that needs nothing is left exactly as it came."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from driver.engine.constraint_processors import NONE, Constraints, add_bias, ban, force, padded
from cluster.device_lists import on_device
from driver.engine.request import SamplingParams
from driver.engine.structured import mask_rows


@dataclass(frozen=True)
class SampleRow:
    """What one row of a sampling step needs, on the host."""

    request_id: str
    params: SamplingParams
    key: int  # the request's 64-bit noise key (driver.engine.counter_noise.request_key)
    index: int  # the token index: how many tokens the request has generated, counting those before a restart
    seen: tuple[int, ...] = ()  # the token ids a repetition penalty applies to (prompt and generated)
    logprobs: bool = False
    constraints: Constraints = NONE  # the generation options' edits for this step
    counts: tuple[tuple[int, int], ...] = ()  # (token, times generated) when a presence/frequency penalty is set
    top: int = 0  # how many of the most probable tokens to report with their logprobs
    allowed: torch.Tensor | None = None  # a structured output's bitmask of allowed tokens (structured.py)
    logprobs_mode: str = "processed_logprobs"  # what its logprobs report (driver/engine/logprobs_mode.py)

    @property
    def samples(self) -> bool:
        return self.params.do_sample

    @property
    def plain(self) -> bool:
        """Greedy with nothing to process: its token is the argmax of its raw logits."""
        c = self.constraints
        return (not self.params.do_sample and not self.penalised and not (c.bias or c.forced or c.banned)
                and not self.params.logit_bias and not self.counts and self.allowed is None)

    @property
    def penalised(self) -> bool:
        return self.params.repetition_penalty != 1.0 and bool(self.seen)

    @property
    def scaled(self) -> bool:
        return self.params.do_sample and self.params.temperature != 1.0

    def filtered(self, vocab: int) -> bool:
        p = self.params
        return p.do_sample and (0 < p.top_k < vocab or p.top_p < 1.0)


def on_rows(x: torch.Tensor, rows: list[int], fn: Callable[[torch.Tensor, list[int]], torch.Tensor],
            original: torch.Tensor) -> torch.Tensor:
    """x with rows `rows` replaced by fn(those rows, rows); `original` (the caller's input) is never written."""
    if not rows:
        return x
    if len(rows) == x.shape[0]:
        return fn(x, rows)
    index = on_device(rows, torch.long, x.device)
    out = x.clone() if x is original else x
    return out.index_copy_(0, index, fn(x.index_select(0, index), rows))


def additive_penalties(x: torch.Tensor, counts: list[tuple[tuple[int, int], ...]], frequency: list[float],
                       presence: list[float]) -> torch.Tensor:
    """OpenAI's penalties: each generated token's logit less count * frequency + presence (padding: count 0)."""
    ids = on_device(padded([tuple(t for t, _ in c) for c in counts]), torch.long, x.device)
    n = on_device(padded([tuple(k for _, k in c) for c in counts], 0), x.dtype, x.device)
    penalty = n * column(frequency, x.dtype, x.device) + (n > 0) * column(presence, x.dtype, x.device)
    return x.scatter_add(1, ids, -penalty)


def column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row parameters as an [N, 1] tensor on `device`."""
    return on_device(values, dtype, device)[:, None]


def penalise(x: torch.Tensor, seen: list[tuple[int, ...]], penalty: list[float]) -> torch.Tensor:
    """transformers' repetition penalty: seen tokens' logits divided by the penalty (multiplied when negative)."""
    ids = on_device(padded(seen), torch.long, x.device)  # shorter rows repeat their first token: written again
    p = column(penalty, x.dtype, x.device)
    score = x.gather(1, ids)
    return x.scatter(1, ids, torch.where(score < 0, score * p, score / p))


CANDIDATES = (256, 4096)  # top-p on the CPU ranks this many of a row's most probable tokens first, then this many


def top_p_drops(probs: torch.Tensor, order: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[N, vocab] True where top-p drops a token, given each row's most probable tokens in descending order
    (`order`, [N, m]) that hold more than top_p (a token past them has more than top_p before it: dropped)."""
    ranked = probs.gather(1, order)
    drop = (ranked.cumsum(-1) - ranked > top_p) & (top_p < 1.0)  # no top-p: nothing dropped, whatever rounding says
    return (top_p < 1.0).expand(probs.shape).clone().scatter_(1, order, drop)


def ranked_drops(probs: torch.Tensor, top_p: torch.Tensor, least: int,
                 tries: tuple[int, ...] = CANDIDATES) -> torch.Tensor:
    """top_p_drops, ranking as few tokens as exactness allows: each row's top-k (`least`, when every row has one);
    else, on the CPU (where reading a value waits on nothing), the `tries[0]` most probable tokens where they hold
    more than top_p, then the next tries, then the whole sorted vocabulary (on other devices, at once)."""
    vocab = probs.shape[-1]
    if least < vocab:
        return top_p_drops(probs, torch.topk(probs, least, dim=-1).indices, top_p)
    tries = tuple(m for m in tries if m < vocab) if probs.device.type == "cpu" else ()
    if not tries:
        return top_p_drops(probs, torch.sort(probs, dim=-1, descending=True).indices, top_p)
    top, order = torch.topk(probs, tries[0], dim=-1)
    short = ((top.sum(-1) <= top_p[:, 0]) & (top_p[:, 0] < 1.0)).nonzero()[:, 0].tolist()

    def wider(_: torch.Tensor, ix: list[int]) -> torch.Tensor:
        index = on_device(ix, torch.long, probs.device)
        return ranked_drops(probs.index_select(0, index), top_p.index_select(0, index), vocab, tries[1:])

    return on_rows(top_p_drops(probs, order, top_p), short, wider, None)


def top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """-inf where top-k and then top-p drop a token. Top-k keeps the logits >= the row's k-th largest (0 or -1: off);
    top-p keeps, of those, each token whose more probable tokens (in descending order) hold at most top_p."""
    vocab = x.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    with_k = [k for k in ks if k < vocab]
    if with_k:
        largest = torch.topk(x, max(with_k), dim=-1).values
        kth = largest.gather(1, column([min(k, largest.shape[-1]) - 1 for k in ks], torch.long, x.device))
        kth = kth.masked_fill(column([k == vocab for k in ks], torch.bool, x.device), float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    if all(p >= 1.0 for p in top_p):
        return x
    least = max(with_k) if len(with_k) == len(ks) else vocab
    return x.masked_fill(ranked_drops(x.softmax(-1), column(top_p, x.dtype, x.device), least), float("-inf"))


def process_logits(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Sequence and logit bias, repetition penalty, presence and frequency penalties, forced and banned tokens, a
    structured output's mask, temperature, top-k and top-p for a batch
    (the input itself when no row needs anything). Never writes into `logits`."""
    vocab = logits.shape[-1]
    x = on_rows(logits, [i for i, r in enumerate(rows) if r.constraints.bias or r.params.logit_bias],
                lambda t, ix: add_bias(t, [rows[i].constraints.bias + rows[i].params.logit_bias for i in ix]), logits)
    x = on_rows(x, [i for i, r in enumerate(rows) if r.penalised], lambda t, ix: penalise(
        t, [rows[i].seen for i in ix], [rows[i].params.repetition_penalty for i in ix]), logits)
    x = on_rows(x, [i for i, r in enumerate(rows) if r.counts], lambda t, ix: additive_penalties(
        t, [rows[i].counts for i in ix], [rows[i].params.frequency_penalty for i in ix],
        [rows[i].params.presence_penalty for i in ix]), logits)
    x = on_rows(x, [i for i, r in enumerate(rows) if r.constraints.forced], lambda t, ix: force(
        t, [rows[i].constraints.forced for i in ix]), logits)
    x = on_rows(x, [i for i, r in enumerate(rows) if r.constraints.banned], lambda t, ix: ban(
        t, [rows[i].constraints.banned for i in ix]), logits)
    x = on_rows(x, [i for i, r in enumerate(rows) if r.allowed is not None], lambda t, ix: mask_rows(
        t, [rows[i].allowed for i in ix]), logits)
    x = on_rows(x, [i for i, r in enumerate(rows) if r.scaled], lambda t, ix: t / column(
        [rows[i].params.temperature for i in ix], t.dtype, t.device), logits)
    return on_rows(x, [i for i, r in enumerate(rows) if r.filtered(vocab)], lambda t, ix: top_k_top_p(
        t, [rows[i].params.top_k for i in ix], [rows[i].params.top_p for i in ix]), logits)
