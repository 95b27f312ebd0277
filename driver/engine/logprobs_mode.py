"""vLLM's `logprobs_mode`: which figures a token's logprobs and top_logprobs report. `processed_logprobs` (Lockstep's
default, as before: the log-softmax of the logits after the sampling processors: biases, penalties, bans,
structured-output masks, temperature, top-k and top-p), `raw_logprobs` (vLLM's default: the log-softmax of the
model's own logits, before any processor), `processed_logits` and `raw_logits` (the logits themselves, not
normalised). A filtered token's processed figure is -inf. Chosen per request (else the preset's), per row on the
logits' device beside the picks: no extra transfer."""

from __future__ import annotations

import torch

from driver.engine.logits_processing import SampleRow
from driver.engine.top_logprobs import Top, top_of


def reported(logits: torch.Tensor, processed: torch.Tensor, rows: list[SampleRow], tokens: torch.Tensor
             ) -> tuple[torch.Tensor, Top | None]:
    """Each row's chosen-token figure [N] and its top tokens (by the same figure), as each row's mode asks."""
    raw = [r.logprobs_mode.startswith("raw") for r in rows]
    normed = [r.logprobs_mode.endswith("logprobs") for r in rows]
    if all(raw):
        source = logits
    elif not any(raw):
        source = processed
    else:
        mask = torch.tensor(raw, device=logits.device)[:, None]
        source = torch.where(mask, logits, processed)
    norm = source.logsumexp(-1, keepdim=True)
    if not all(normed):
        norm = torch.where(torch.tensor(normed, device=logits.device)[:, None], norm, torch.zeros_like(norm))
    chosen = source.gather(1, tokens[:, None])[:, 0] - norm[:, 0]
    return chosen, top_of(source, [r.top for r in rows], norm)
