"""The n-gram proposer (prompt lookup; docs/speculative.md), on rank 0: a request's next tokens guessed from its own
tokens. The last n tokens of the prompt and output, n from `prompt_lookup_max` down to `prompt_lookup_min`, are
looked up at their latest earlier occurrence; the up to k tokens that followed it are the proposal. Plain numpy
over the request's tokens: no model, nothing on the device, nothing the workers see."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """`k` tokens that followed the latest earlier occurrence of `tokens`' last n tokens (the longest n in
    [n_min, n_max] that occurs earlier), or none ([0] int64). An occurrence is earlier when it ends before the
    last token, so at least one token followed it. When fewer than k tokens follow it the copy runs on into the
    proposal itself (as an overlapping LZ77 copy does): a repeating stretch is proposed whole."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        tail = tokens[size - n:]
        windows = sliding_window_view(tokens[:size - 1], n)  # windows[j] = tokens[j:j+n], each followed by a token
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            period = size - start  # the match ends this many tokens before the end: the pattern repeats with it
            return tokens[start + np.arange(k) % period].astype(np.int64, copy=False)
    return np.zeros(0, np.int64)
