"""transformers' generation options as three batch-wise edits of the logits: a sparse bias, a forced row, bans.

transformers applies, in `_get_logits_processor`'s order: sequence bias, repetition penalty, no-repeat n-gram, bad
words, min length, min new tokens, forced BOS, forced EOS, suppressed tokens, tokens suppressed at the beginning.
Setting a token to -inf is idempotent and commutes with the others, and forcing replaces the whole row, so the same
result comes from: the bias (before the penalty, logits_processing.py), then the forced row, then one ban of the
union of the masks after forcing, with those before it when the row is not forced. The host decides each row's
edit from the request (all its tokens are on the host then) and sends ids to the device; nothing waits on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from driver.engine.block_manager import token_slice
from cluster.device_lists import on_device
from driver.engine.request import Request


@dataclass(frozen=True)
class Constraints:
    """One row's edits for this step, on the host."""

    bias: tuple[tuple[int, float], ...] = ()  # (token, summed bias) added to its logit, before the penalty
    forced: tuple[int, ...] = ()  # non-empty: the row becomes -inf except these, which become 0
    banned: tuple[int, ...] = ()  # set to -inf after forcing


NONE = Constraints()


def suffix_tables(sequences: list[tuple[tuple[int, ...], object]]) -> list[tuple[int, dict[tuple[int, ...], list]]]:
    """(prefix length, {prefix: [(last token, value), ...]}) for the sequences longer than one token, grouped by
    prefix length in order of first appearance (transformers' order of summing)."""
    groups: dict[int, dict[tuple[int, ...], list]] = {}
    for seq, value in sequences:
        if len(seq) > 1:
            groups.setdefault(len(seq) - 1, {}).setdefault(seq[:-1], []).append((seq[-1], value))
    return list(groups.items())


class NgramIndex:
    """The request's n-grams so far: (first n-1 tokens) -> the tokens that followed them, extended as tokens come."""

    def __init__(self, n: int):
        self.n = n
        self.upto = 0  # the token count whose n-grams are indexed
        self.follows: dict[tuple[int, ...], set[int]] = {}

    def bans(self, req: Request) -> set[int]:
        """NoRepeatNGramLogitsProcessor: the tokens that would complete an n-gram the sequence already holds."""
        n, total = self.n, req.num_tokens
        if total + 1 < self.upto:  # the sequence never shrinks; rebuild if it ever does
            self.upto, self.follows = 0, {}
        if total < n:
            return set()
        start = max(self.upto, n)
        window = token_slice(req, start - n, total)
        for end in range(start, total + 1):
            gram = window[end - n - (start - n):end - (start - n)]
            self.follows.setdefault(tuple(gram[:-1]), set()).add(gram[-1])
        self.upto = total + 1
        return self.follows.get(tuple(token_slice(req, total - n + 1, total)), set())


@dataclass
class History:
    """What a request's options keep between steps: tables built once from its parameters, and its n-grams."""

    bias_single: dict[int, float]
    bias_tables: list[tuple[int, dict[tuple[int, ...], list]]]
    bad_single: set[int]
    bad_tables: list[tuple[int, dict[tuple[int, ...], list]]]
    ngrams: NgramIndex | None = None
    longest: int = field(default=0)  # the longest prefix any table reads

    @classmethod
    def of(cls, req: Request) -> History:
        p = req.sampling
        bad = [(s, None) for s in p.bad_words_ids if not (len(s) == 1 and s[0] in req.eos_token_ids)]
        hist = cls({s[0]: b for s, b in p.sequence_bias if len(s) == 1}, suffix_tables(list(p.sequence_bias)),
                   {s[0] for s, _ in bad if len(s) == 1}, suffix_tables(bad),
                   NgramIndex(p.no_repeat_ngram_size) if p.no_repeat_ngram_size > 0 else None)
        hist.longest = max([k for k, _ in hist.bias_tables + hist.bad_tables], default=0)
        return hist

    def matches(self, tables: list[tuple[int, dict[tuple[int, ...], list]]], req: Request) -> list[list]:
        """The (last token, value) lists of every sequence whose prefix ends the request's tokens, in table order."""
        total = req.num_tokens
        tail = token_slice(req, max(0, total - self.longest), total)
        return [t[tuple(tail[len(tail) - k:])] for k, t in tables if k <= total and tuple(tail[len(tail) - k:]) in t]

    def bias(self, req: Request) -> tuple[tuple[int, float], ...]:
        """SequenceBiasLogitsProcessor's row, summed in float32 in its order: single tokens, then sequences."""
        total: dict[int, np.float32] = {t: np.float32(0) + np.float32(b) for t, b in self.bias_single.items()}
        for found in self.matches(self.bias_tables, req):
            for tok, b in found:
                total[tok] = total.get(tok, np.float32(0)) + np.float32(b)
        return tuple((t, float(b)) for t, b in total.items())

    def bad(self, req: Request) -> set[int]:
        """NoBadWordsLogitsProcessor: single bad tokens and the last token of each bad sequence it would complete."""
        out = set(self.bad_single)
        for found in self.matches(self.bad_tables, req):
            out.update(tok for tok, _ in found)
        return out


def constraints(req: Request) -> Constraints:
    """The request's edits for the token it samples next (every earlier token is on the host)."""
    p = req.sampling
    if not p.constrained:
        return NONE
    if req.history is None:
        req.history = History.of(req)
    hist: History = req.history
    forced: tuple[int, ...] = ()
    if p.forced_eos_token_id and len(req.generated) == req.max_new_tokens - 1:
        forced = p.forced_eos_token_id
    elif p.forced_bos_token_id is not None and req.num_tokens == 1:
        forced = (p.forced_bos_token_id,)
    banned: set[int] = set()
    if not forced:
        if hist.ngrams is not None:
            banned |= hist.ngrams.bans(req)
        banned |= hist.bad(req)
        # MinLength/MinNewTokensLength: no EOS while the sequence (prompt included) is shorter than min_length or,
        # when min_new_tokens is set (it overrides min_length), while fewer new tokens exist
        short = req.num_tokens < p.min_length if p.min_new_tokens is None else req.token_index < p.min_new_tokens
        if req.eos_token_ids and short:
            banned |= req.eos_token_ids
    banned.update(p.suppress_tokens)
    # SuppressTokensAtBegin's step: the first new token, or the second when a one-token prompt has a forced BOS
    one_token_prompt = len(req.prompt_ids) - req.resumed_tokens <= 1
    if p.begin_suppress_tokens and req.token_index == int(one_token_prompt and p.forced_bos_token_id is not None):
        banned.update(p.begin_suppress_tokens)
    return Constraints(hist.bias(req), forced, tuple(sorted(banned)))


def padded(lists: list[tuple], fill: object | None = None) -> list[list]:
    """Rows of equal width: each padded with `fill`, or with its own first entry when `fill` is None."""
    width = max(len(x) for x in lists)
    return [list(x) + [x[0] if fill is None else fill] * (width - len(x)) for x in lists]


def add_bias(x: torch.Tensor, biases: list[tuple[tuple[int, float], ...]]) -> torch.Tensor:
    """Each row's (token, bias) pairs added to its logits (padding adds 0.0 to a row's first token)."""
    ids = on_device(padded([tuple(t for t, _ in b) for b in biases]), torch.long, x.device)
    values = on_device(padded([tuple(v for _, v in b) for b in biases], 0.0), x.dtype, x.device)
    return x.scatter_add(1, ids, values)


def force(x: torch.Tensor, forced: list[tuple[int, ...]]) -> torch.Tensor:
    """Each row -inf except its forced tokens, which are 0."""
    ids = on_device(padded(forced), torch.long, x.device)
    return torch.full_like(x, float("-inf")).scatter_(1, ids, 0.0)


def ban(x: torch.Tensor, banned: list[tuple[int, ...]]) -> torch.Tensor:
    """Each row's banned tokens set to -inf."""
    ids = on_device(padded(banned), torch.long, x.device)
    return x.scatter(1, ids, float("-inf"))
