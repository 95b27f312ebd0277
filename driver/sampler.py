"""Next-token choice on the driver, for the whole batch at once on the logits' device: greedy, or temperature /
top-k / top-p sampling, with repetition penalty and logprobs.

Sampling is counter-based Gumbel-max: token = argmax(processed logits + g), with g the Gumbel noise that
driver.counter_noise derives from (the request's key, its token index, the token id). The key comes from
(config seed or request seed, request id), or is random when neither gives a seed, and is made once per request
on the host. So a seeded request samples the same tokens whatever else shares its batches, at any TP size, on
any device, and after any number of restarts. Greedy rows get no noise: their token is the argmax of their
(penalised) logits. Nothing waits on the device until the one transfer of (tokens, logprobs) at the end.

A row that fails (a bad value that slipped through, NaN logits, an injected fault) fails only its own request:
the sampler returns the exception for that row and the engine fails that request alone. When the batched
computation raises, the sampler computes the rows again one by one, with the same functions, to find out which.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cluster import faults
from driver.counter_noise import gumbel, request_key, signed64
from driver.logits_processing import SampleRow, on_rows, process_logits
from driver.request import Request


class Draw(NamedTuple):
    """One row's outcome: the token and its logprob (when asked for), or the exception that sampling raised."""

    token: int | None
    logprob: float | None = None
    error: Exception | None = None


class InvalidLogits(RuntimeError):
    """A row whose logits hold NaN or +inf, or whose processors left no token to choose."""


class Picks(NamedTuple):
    """A batch's choices, on the logits' device: tokens [N] int64, logprobs [N] float32, invalid [N] bool."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    invalid: torch.Tensor


def with_noise(processed: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Sampling rows' processed logits plus their Gumbel noise; other rows unchanged."""
    def noisy(x: torch.Tensor, ix: list[int]) -> torch.Tensor:
        keys = torch.tensor([signed64(rows[i].key) for i in ix], dtype=torch.int64, device=x.device)
        index = torch.tensor([rows[i].index for i in ix], dtype=torch.int64, device=x.device)
        return x + gumbel(keys, index, x.shape[-1])

    return on_rows(processed, [i for i, r in enumerate(rows) if r.samples], noisy, processed)


def pick(logits: torch.Tensor, rows: list[SampleRow]) -> Picks:
    """The batch's tokens and logprobs ([N, vocab] logits, one row each), computed on the logits' device in
    float32 without waiting on it."""
    logits = logits.float()
    processed = process_logits(logits, rows)
    scores = with_noise(processed, rows)
    best, tokens = scores.max(-1)  # the first of equal maxima, as argmax
    invalid = logits.sum(-1).isnan() | ~best.isfinite()  # a NaN anywhere in a row makes its sum NaN
    if any(r.logprobs for r in rows):
        logprobs = processed.gather(1, tokens[:, None])[:, 0] - processed.logsumexp(-1)
    else:
        logprobs = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    return Picks(tokens, logprobs, invalid)


def sample_row(req: Request, seed: int | None) -> SampleRow:
    """The request's row for this step; its noise key is made on first use and kept on the request."""
    p = req.sampling
    if req.sample_key is None:
        req.sample_key = request_key(p.seed if p.seed is not None else seed, req.request_id)
    return SampleRow(req.request_id, p, req.sample_key, req.token_index,
                     tuple(set(req.tokens)) if p.repetition_penalty != 1.0 else (), req.return_logprobs)


def draws(logits: torch.Tensor, rows: list[SampleRow]) -> list[Draw]:
    """pick, then the step's one transfer to the host."""
    picks = pick(logits, rows)
    host = torch.stack([picks.tokens.double(), picks.logprobs.double(), picks.invalid.double()]).tolist()
    out = []
    for row, tok, lp, bad in zip(rows, *host):
        if bad:
            out.append(Draw(None, None, InvalidLogits(
                f"request {row.request_id}: its logits hold NaN or +inf, or no token survived its processors")))
        else:
            out.append(Draw(int(tok), lp if row.logprobs else None))
    return out


class Sampler:
    def __init__(self, seed: int | None):
        self.seed = seed

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[Draw]:
        """One draw per row of `logits` [N, vocab]; a row's failure is its Draw's `error`, never an exception."""
        out: list[Draw | None] = [None] * len(reqs)
        live: list[int] = []
        rows: list[SampleRow] = []
        for i, req in enumerate(reqs):
            try:
                faults.hit("sample", request=req.request_id)
                rows.append(sample_row(req, self.seed))
                live.append(i)
            except Exception as e:  # noqa: BLE001  (whatever it is, it belongs to this request alone)
                out[i] = Draw(None, None, e)
        if live:
            mine = logits if len(live) == len(reqs) else logits[torch.tensor(live, device=logits.device)]
            try:
                got = draws(mine, rows)
            except Exception:  # noqa: BLE001  (some row broke the batch: find which, one row at a time)
                got = [self._alone(mine[j:j + 1], row) for j, row in enumerate(rows)]
            for i, draw in zip(live, got):
                out[i] = draw
        return out

    @staticmethod
    def _alone(logits: torch.Tensor, row: SampleRow) -> Draw:
        try:
            return draws(logits, [row])[0]
        except Exception as e:  # noqa: BLE001
            return Draw(None, None, e)
