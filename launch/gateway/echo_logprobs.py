"""`echo` with `logprobs` on /v1/completions: the prompt's tokens with their logprobs, as OpenAI and vLLM answer them
(the first token's logprob and top_logprobs null), from the final output's `prompt_logprobs` and
`prompt_top_logprobs` (the submit's `prompt_logprobs`: driver/engine/prompt_scores.py), then the completion's.
Torch-free."""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any, Callable

from cluster.outputs import GenerationOutput

MIN_LOGPROB = -9999.0  # what a -inf logprob (a token its filters dropped) is reported as: JSON has no infinity


def finite(logprob: float | None) -> float | None:
    """A logprob JSON can carry: -inf as MIN_LOGPROB, NaN (a token delivered before a resume) and None as null."""
    return None if logprob is None or math.isnan(logprob) else max(logprob, MIN_LOGPROB)


def prompt_logprobs(out: GenerationOutput, token_text: Callable[[int], str]) -> dict[str, list]:
    """The prompt's part of a completion choice's `logprobs`: each prompt token's text, logprob and top tokens (the
    position's most probable ones and the token itself), with text offsets from 0; the first token's are null."""
    texts = [token_text(t) for t in out.prompt_ids]
    logprobs = [finite(lp) for lp in out.prompt_logprobs or [None] * len(texts)]
    tops: list[dict[str, Any] | None] = []
    for i, (s, lp) in enumerate(zip(texts, logprobs)):
        alts = (out.prompt_top_logprobs or [()] * len(texts))[i]
        tops.append(None if lp is None else {token_text(t): finite(v) for t, v in alts} | {s: lp})
    offsets = list(accumulate(map(len, texts), initial=0))[:-1]
    return {"tokens": texts, "token_logprobs": logprobs, "text_offset": offsets, "top_logprobs": tops}


def joined(prompt: dict[str, list], completion: dict[str, list] | None) -> dict[str, list]:
    """The prompt's logprobs then the completion's, key by key."""
    return {k: v + (completion[k] if completion is not None else []) for k, v in prompt.items()}
