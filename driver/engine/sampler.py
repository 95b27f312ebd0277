"""Next-token choice on the driver, for the whole batch at once on the logits' device (docs/architecture.md, "The
driver"): counter-based Gumbel-max, token = argmax(processed logits + g), g the noise driver.engine.counter_noise
derives from (the request's key, its token index, the token id); greedy rows get no noise. Nothing waits on the
device until the one transfer of (tokens, logprobs): `launch` starts it and `collect` waits for it. A row that
fails fails only its own request: when the batched computation raises, the rows are computed again one by one."""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np
import torch

from cluster import faults
from driver.engine.constraint_processors import constraints
from driver.engine.counter_noise import gumbel, request_key, signed64
from cluster.device_lists import on_device
from driver.engine.logits_processing import SampleRow, on_rows, process_logits
from driver.engine.request import Request
from driver.engine.logprobs_mode import reported
from driver.engine.top_logprobs import Top, top_pairs, top_to_host
from worker.shard_argmax import ShardArgmax


class Draw(NamedTuple):
    """One row's outcome: the token and its logprob (when asked for), or the exception that sampling raised."""

    token: int | None
    logprob: float | None = None
    error: Exception | None = None
    top: tuple[tuple[int, float], ...] | None = None  # the most probable tokens and logprobs, when asked for


class InvalidLogits(RuntimeError):
    """A row whose logits hold NaN or +inf, or whose processors left no token to choose."""


class Picks(NamedTuple):
    """A batch's choices, on the logits' device: tokens [N] int64, logprobs [N] float32, invalid [N] bool, and
    the most probable tokens of the rows that ask (None: none asks)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    invalid: torch.Tensor
    top: Top | None = None


def with_noise(processed: torch.Tensor, rows: list[SampleRow], offset: int = 0,
               index: list[int] | None = None) -> torch.Tensor:
    """Sampling rows' processed logits plus their Gumbel noise (token index + offset; the index: `index[i]` when
    given, else row.index)."""
    at = index if index is not None else [r.index for r in rows]

    def noisy(x: torch.Tensor, ix: list[int]) -> torch.Tensor:
        keys = on_device([signed64(rows[i].key) for i in ix], torch.int64, x.device)
        index = on_device([at[i] + offset for i in ix], torch.int64, x.device)
        return x + gumbel(keys, index, x.shape[-1])

    return on_rows(processed, [i for i, r in enumerate(rows) if r.samples], noisy, processed)


def pick(logits: torch.Tensor, rows: list[SampleRow], offset: int = 0, plain: bool | None = None,
         index: list[int] | None = None) -> Picks:
    """The batch's tokens and logprobs, in float32, without waiting on the device. `offset`: the rows' tokens come
    that many after their token index (a burst's later forwards); `index`: each row's, else its row.index.
    `plain`: every row is SampleRow.plain (None: look)."""
    logits = logits.float()
    if plain is None:
        plain = all(r.plain for r in rows)
    processed = logits if plain else process_logits(logits, rows)
    scores = processed if plain else with_noise(processed, rows, offset, index)
    best, tokens = scores.max(-1)  # the first of equal maxima, as argmax
    invalid = ~best.isfinite()  # max propagates a NaN, so an unprocessed row's NaN shows here
    if processed is not logits:  # a filter may have masked a NaN away: a NaN anywhere makes the row's sum NaN
        invalid |= logits.sum(-1).isnan()
    if any(r.logprobs for r in rows):  # as each row's logprobs_mode asks, its top tokens too
        logprobs, top = reported(logits, processed, rows, tokens)
    else:
        logprobs, top = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device), None
    return Picks(tokens, logprobs, invalid, top)


def sample_row(req: Request, seed: int | None, ahead: int = 0) -> SampleRow:
    """The request's row, `ahead` tokens after those on the host; its noise key is made on first use. A request
    whose sampling reads no history gets the same row every step but for its index: it is kept (index 0) and
    the index travels beside it (`Sampler.rows`)."""
    p = req.sampling
    if req.sample_key is None:
        req.sample_key = request_key(p.seed, seed, req.request_id, req.child_index)
    if not p.needs_history:
        if req.sample_cache is None:
            req.sample_cache = SampleRow(req.request_id, p, req.sample_key, 0, (), req.return_logprobs,
                                         top=req.num_top_logprobs, logprobs_mode=req.logprobs_mode)
        return req.sample_cache
    return SampleRow(req.request_id, p, req.sample_key, req.token_index + ahead,
                     tuple(set(req.tokens)) if p.repetition_penalty != 1.0 else (), req.return_logprobs,
                     constraints(req), generated_counts(req), req.num_top_logprobs,
                     None if req.grammar is None else req.grammar.allowed(all_generated(req)), req.logprobs_mode)


def all_generated(req: Request) -> list[int]:
    """Every token the request generated, those before a restart (the tail of its prompt) first."""
    return (req.prompt_ids[len(req.prompt_ids) - req.resumed_tokens:] + req.generated if req.resumed_tokens
            else req.generated)


def generated_counts(req: Request) -> tuple[tuple[int, int], ...]:
    """(token, times generated) over the request's generated tokens, those before a restart included, when a
    presence or frequency penalty reads them (else empty)."""
    p = req.sampling
    if p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
        return ()
    return tuple(Counter(all_generated(req)).items())


class Launched(NamedTuple):
    """One step's sampling, started on the device: `tokens` [rows of logits] int64 stays there (a row that failed
    early: 0, or its argmax when the ranks chose); `host` ([3, live rows] float64, pinned on CUDA) fills when `event`
    fires. `early`: the outcomes known at launch (failed rows, or all when the batch fell back to one at a time)."""

    tokens: torch.Tensor
    early: list[Draw | None]
    live: list[int]
    rows: list[SampleRow]
    host: torch.Tensor | None
    event: object = None
    top: Top | None = None  # the rows' most probable tokens, on the host once `event` fires


def to_host(picks: Picks) -> tuple[torch.Tensor, object, Top | None]:
    """Start the one transfer of (tokens, logprobs, invalid) and the top tokens to the host; returns (host tensor,
    CUDA event, top on the host)."""
    stacked = torch.stack([picks.tokens.double(), picks.logprobs.double(), picks.invalid.double()])
    if stacked.device.type != "cuda":
        return stacked, None, picks.top
    host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True).copy_(stacked, non_blocking=True)
    top = top_to_host(picks.top)
    event = torch.cuda.Event()
    event.record()
    return host, event, top


def host_draws(host: torch.Tensor, rows: list[SampleRow], top: Top | None = None) -> list[Draw]:
    """Draws from the transferred (tokens, logprobs, invalid) rows and their top tokens."""
    out = []
    for row, tok, lp, bad, alts in zip(rows, *host.tolist(), top_pairs(top, [r.top for r in rows])):
        if bad:
            out.append(Draw(None, None, InvalidLogits(
                f"request {row.request_id}: its logits hold NaN or +inf, or no token survived its processors")))
        else:
            out.append(Draw(int(tok), lp if row.logprobs else None, top=alts))
    return out


class Sampler:
    def __init__(self, seed: int | None):
        self.seed = seed

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[Draw | None]:
        """One draw per row of `logits` [N, vocab]; a row's failure is its Draw's `error`, never an exception."""
        return self.collect(self.launch(logits, *self.rows(reqs)))

    def rows(self, reqs: list[Request | None], ahead: list[int] | None = None
             ) -> tuple[list[Draw | None], list[int], list[SampleRow], bool, list[int]]:
        """The host half of a launch, on the loop thread once every earlier token is on the host (or with `ahead`,
        each request's tokens in flight, when no row needs its token history): (early failures, live row numbers,
        their SampleRows, whether every row is plain greedy, their token indexes). A None request (ended meanwhile)
        gets no row."""
        if not faults.RULES and None not in reqs:  # the common case: every row is live
            try:
                return self._all_rows(reqs, ahead)
            except Exception:  # noqa: BLE001  (some row failed: find which, below, one row at a time)
                pass
        early: list[Draw | None] = [None] * len(reqs)
        live: list[int] = []
        rows: list[SampleRow] = []
        index: list[int] = []
        for i, req in enumerate(reqs):
            if req is None:
                continue
            try:
                faults.hit("sample", request=req.request_id)
                rows.append(sample_row(req, self.seed, ahead[i] if ahead else 0))
                index.append(req.token_index + (ahead[i] if ahead else 0))
                live.append(i)
            except Exception as e:  # noqa: BLE001  (whatever it is, it belongs to this request alone)
                early[i] = Draw(None, None, e)
        return early, live, rows, all(r.plain for r in rows), index

    def _all_rows(self, reqs: list[Request], ahead: list[int] | None
                  ) -> tuple[list[Draw | None], list[int], list[SampleRow], bool, list[int]]:
        """`rows` when every row is live and none may fail: kept rows where sampling reads no history."""
        rows = [r.sample_cache if r.sample_cache is not None  # kept; a history row is made anew every step
                else sample_row(r, self.seed, ahead[i] if ahead else 0) for i, r in enumerate(reqs)]
        index = [r.resumed_tokens + len(r.generated) for r in reqs]
        if ahead is not None:
            index = [i + a for i, a in zip(index, ahead)]
        return [None] * len(reqs), list(range(len(reqs))), rows, all(r.plain for r in rows), index

    def launch(self, logits: torch.Tensor | ShardArgmax, early: list[Draw | None], live: list[int],
               rows: list[SampleRow], plain: bool = False, token_index: list[int] | None = None,
               offset: int = 0) -> Launched:
        """The device half: pick every live row and start the transfer, without waiting on the device (unless some
        row breaks the batch: then one row at a time, here). ShardArgmax: the ranks chose the tokens already.
        `token_index`: each live row's token index (Sampler.rows), else its row.index."""
        chosen = isinstance(logits, ShardArgmax)
        device = logits.tokens.device if chosen else logits.device
        n = len(early)
        if not live:
            return Launched(logits.tokens if chosen else torch.zeros(n, dtype=torch.int64, device=device), early,
                            live, rows, None)
        index = None if len(live) == n else on_device(live, torch.int64, device)
        if chosen:  # the plan's argmax_on_shards (plain greedy, no logprobs), with the check `pick` makes
            best, tokens = logits if index is None else (logits.best[index], logits.tokens[index])
            host, event, _ = to_host(Picks(tokens, torch.zeros_like(best), ~best.isfinite()))
            return Launched(logits.tokens, early, live, rows, host, event)
        mine = logits if index is None else logits[index]
        try:
            picks = pick(mine, rows, offset, plain, token_index)
        except Exception:  # noqa: BLE001  (some row broke the batch: find which, one row at a time)
            alone = list(early)
            for k, (j, row) in enumerate(zip(live, rows)):
                alone[j] = self._alone(logits[j:j + 1], row, offset + (token_index[k] - row.index if token_index else 0))
            tokens = torch.tensor([d.token if d is not None and d.token is not None else 0 for d in alone],
                                  dtype=torch.int64)
            return Launched(tokens.to(logits.device), alone, [], [], None)
        tokens = picks.tokens if index is None else torch.zeros(n, dtype=torch.int64, device=logits.device).index_copy_(
            0, index, picks.tokens)
        host, event, top = to_host(picks)
        return Launched(tokens, early, live, rows, host, event, top)

    @staticmethod
    def collect(launched: Launched) -> list[Draw]:
        """Wait for the transfer (the step's only host sync) and give one Draw per logits row."""
        out = list(launched.early)
        if launched.host is not None:
            if launched.event is not None:
                launched.event.synchronize()
            for i, draw in zip(launched.live, host_draws(launched.host, launched.rows, launched.top)):
                out[i] = draw
        return out

    @staticmethod
    def collect_tokens(launched: Launched) -> tuple[np.ndarray, np.ndarray | None] | None:
        """`collect` as arrays, (tokens int64, logprobs float64 when some row asked), when every row is live and
        drew a token; else None (then `collect`)."""
        if launched.host is None or launched.top is not None or len(launched.live) != len(launched.early) or \
                launched.early.count(None) != len(launched.early):
            return None
        if launched.event is not None:
            launched.event.synchronize()
        host = launched.host.numpy()
        if host[2].any():
            return None
        return host[0].astype(np.int64), host[1] if any(r.logprobs for r in launched.rows) else None

    @staticmethod
    def collect_burst(launched: list[Launched]) -> tuple[list[int], list[list[int]], list[list[float]] | None] | None:
        """A burst's draws at once: (the live rows, each one's tokens, each one's logprobs when some row asked).
        None when some row failed or fell back to one row at a time in any forward: then `collect` one by one."""
        live = launched[0].live
        if any(x.host is None or x.top is not None or x.live != live or any(d is not None for d in x.early)
               for x in launched):
            return None
        for x in launched:
            if x.event is not None:
                x.event.synchronize()
        host = torch.stack([x.host for x in launched])  # [forwards, 3, live rows]
        if bool(host[:, 2].any()):
            return None
        logprobs = host[:, 1].T.tolist() if any(r.logprobs for r in launched[0].rows) else None
        return live, host[:, 0].T.long().tolist(), logprobs

    @staticmethod
    def _alone(logits: torch.Tensor, row: SampleRow, offset: int) -> Draw:
        """One row's pick, then its transfer to the host, waited for."""
        try:
            host, event, top = to_host(pick(logits, [row], offset))
            if event is not None:
                event.synchronize()
            return host_draws(host, [row], top)[0]
        except Exception as e:  # noqa: BLE001
            return Draw(None, None, e)
