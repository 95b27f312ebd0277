"""Next-token choice on the driver: greedy, or temperature / top-k / top-p sampling, with logprobs.

Each sampling request draws from its own torch.Generator, seeded from (config seed or request seed,
request id) through blake2b, so a seeded request gives the same tokens whatever else shares its batches.
A row that fails (a bad value that slipped through, NaN logits, an injected fault) fails only its own request:
the sampler returns the exception for that row and the engine fails that request alone.
"""

from __future__ import annotations

import hashlib
import os
from typing import NamedTuple

import torch

from cluster import faults
from driver.request import Request


class Draw(NamedTuple):
    """One row's outcome: the token and its logprob (when asked for), or the exception that sampling raised."""

    token: int | None
    logprob: float | None = None
    error: Exception | None = None


def request_seed(base: int | None, request_id: str) -> int:
    if base is None:
        return int.from_bytes(os.urandom(8), "little") >> 1
    digest = hashlib.blake2b(f"{base}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def process_logits(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """Apply the request's repetition penalty, temperature, top-k and top-p to one row of logits."""
    p = req.sampling
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.tokens)), dtype=torch.long)
        score = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
    if not p.do_sample:
        return logits
    if p.temperature != 1.0:
        logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest set whose mass reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int | None):
        self.seed = seed

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[Draw]:
        """One draw per row of `logits` [N, vocab]; a row's failure is its Draw's `error`, never an exception."""
        greedy = (logits.argmax(-1).tolist()
                  if all(r.sampling.greedy and not r.return_logprobs for r in reqs) else None)
        draws = []
        for i, req in enumerate(reqs):
            try:
                faults.hit("sample", request=req.request_id)
                draws.append(Draw(greedy[i]) if greedy is not None else self._one(logits[i], req))
            except Exception as e:  # noqa: BLE001  (whatever it is, it belongs to this request alone)
                draws.append(Draw(None, None, e))
        return draws

    def _one(self, row: torch.Tensor, req: Request) -> Draw:
        processed = process_logits(row, req)
        if req.sampling.do_sample:
            if req.generator is None:
                req.generator = torch.Generator().manual_seed(request_seed(
                    req.sampling.seed if req.sampling.seed is not None else self.seed, req.request_id))
            # drawn on the host with the request's CPU generator: the same stream whatever device ran the step
            tok = int(torch.multinomial(processed.softmax(-1).cpu(), 1, generator=req.generator))
        else:
            tok = int(processed.argmax())
        return Draw(tok, float(processed.log_softmax(-1)[tok]) if req.return_logprobs else None)
