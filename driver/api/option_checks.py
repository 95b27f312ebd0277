"""Checks of transformers' generation options a request may carry (GenerationConfig's names, OPTION_CHECKS): each
value normalised to the immutable form SamplingParams holds, or a RequestRejected (bad_field) naming the option and
what it must be. Also the number helpers driver/api/validation.py shares."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

from cluster.errors import Code, RequestRejected
from cluster.protocol import MAX_EOS_TOKEN_IDS

MAX_OPTION_SEQUENCES = 1024  # entries of bad_words_ids or sequence_bias
MAX_OPTION_SEQUENCE_LEN = 32  # tokens in one of them
MAX_OPTION_IDS = 1024  # ids in suppress_tokens or begin_suppress_tokens
MAX_NGRAM_SIZE = 64
MAX_MIN_TOKENS = (1 << 31) - 1  # min_new_tokens, min_length


def integer(v: Any) -> int | None:
    return int(v) if isinstance(v, numbers.Integral) and not isinstance(v, bool) else None


def real(v: Any) -> float | None:
    """v as a float (None when it is not a real number, a bool, or too large for a float)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    try:
        return float(v)
    except OverflowError:
        return None


class BadOption(Exception):
    """Why an option's value is refused (check_option turns it into a RequestRejected)."""


def _count(limit: int) -> Callable[[Any, int | None], int]:
    def check(v: Any, _: int | None) -> int:
        n = integer(v)
        if n is None or not 0 <= n <= limit:
            raise BadOption(f"not an integer in [0, {limit}]")
        return n
    return check


def _token(v: Any, vocab: int | None) -> int:
    t = integer(v)
    if t is None:
        raise BadOption(f"{v!r} is not a token id")
    if t < 0 or (vocab is not None and t >= vocab):
        raise BadOption(f"token id {t} is outside the vocabulary [0, {vocab if vocab is not None else 'vocab'})")
    return t


def _ids(v: Any, vocab: int | None, limit: int, empty: bool = True) -> tuple[int, ...]:
    if hasattr(v, "tolist"):
        v = v.tolist()
    if not isinstance(v, (list, tuple)):
        raise BadOption("not a list of token ids")
    if len(v) > limit or (not v and not empty):
        raise BadOption(f"{len(v)} ids; it takes {0 if empty else 1} to {limit}")
    return tuple(_token(t, vocab) for t in v)


def _sequences(v: Any, vocab: int | None) -> tuple[tuple[int, ...], ...]:
    if not isinstance(v, (list, tuple)) or len(v) > MAX_OPTION_SEQUENCES:
        raise BadOption(f"not a list of at most {MAX_OPTION_SEQUENCES} token sequences")
    return tuple(_ids(s, vocab, MAX_OPTION_SEQUENCE_LEN, empty=False) for s in v)


def _bias(v: Any, vocab: int | None) -> tuple[tuple[tuple[int, ...], float], ...]:
    """[[sequence, bias], ...] (the wire's form) or {tuple: bias}; a sequence given twice keeps its place and takes
    the later bias (transformers builds a dict)."""
    pairs = list(v.items()) if isinstance(v, dict) else v
    if not isinstance(pairs, (list, tuple)) or len(pairs) > MAX_OPTION_SEQUENCES:
        raise BadOption(f"not a list of at most {MAX_OPTION_SEQUENCES} [sequence, bias] pairs")
    out: dict[tuple[int, ...], float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise BadOption("each entry must be a [sequence, bias] pair")
        bias = real(pair[1])
        if bias is None or not math.isfinite(bias):
            raise BadOption(f"bias {pair[1]!r} is not a finite number")
        out[_ids(pair[0], vocab, MAX_OPTION_SEQUENCE_LEN, empty=False)] = bias
    return tuple(out.items())


MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range of one bias: [-100, 100]


def _logit_bias(v: Any, vocab: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, as [[token, bias], ...] (the wire's form) or {token: bias} (token keys may be strings of
    digits, as JSON sends them): (token, bias) pairs, a token given twice takes the later bias."""
    pairs = list(v.items()) if isinstance(v, dict) else v
    if not isinstance(pairs, (list, tuple)) or len(pairs) > MAX_LOGIT_BIAS:
        raise BadOption(f"not a list of at most {MAX_LOGIT_BIAS} [token, bias] pairs")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise BadOption("each entry must be a [token, bias] pair")
        token = int(pair[0]) if isinstance(pair[0], str) and pair[0].isdigit() else pair[0]
        bias = real(pair[1])
        if bias is None or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise BadOption(f"bias {pair[1]!r} is not a number in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        out[_token(token, vocab)] = bias
    return tuple(out.items())


def _structured(v: Any, _: int | None) -> str:
    from driver.engine.structured import BadSpec, grammar_of

    try:
        return grammar_of(v)
    except BadSpec as e:
        raise BadOption(str(e)) from None


def _forced_eos(v: Any, vocab: int | None) -> tuple[int, ...]:
    return (_token(v, vocab),) if integer(v) is not None else _ids(v, vocab, MAX_EOS_TOKEN_IDS, empty=False)


# option -> (normaliser of (value, vocab size or None), what it must be)
OPTION_CHECKS: dict[str, tuple[Callable[[Any, int | None], Any], str]] = {
    "min_new_tokens": (_count(MAX_MIN_TOKENS), f"an integer in [0, {MAX_MIN_TOKENS}]"),
    "min_length": (_count(MAX_MIN_TOKENS), f"an integer in [0, {MAX_MIN_TOKENS}]"),
    "no_repeat_ngram_size": (_count(MAX_NGRAM_SIZE), f"an integer in [0, {MAX_NGRAM_SIZE}]"),
    "bad_words_ids": (_sequences, f"a list of at most {MAX_OPTION_SEQUENCES} lists of 1 to "
                                  f"{MAX_OPTION_SEQUENCE_LEN} token ids"),
    "sequence_bias": (_bias, f"a list of at most {MAX_OPTION_SEQUENCES} [token ids (1 to {MAX_OPTION_SEQUENCE_LEN}), "
                             f"finite bias] pairs"),
    "forced_bos_token_id": (_token, "a token id"),
    "forced_eos_token_id": (_forced_eos, f"a token id or a list of 1 to {MAX_EOS_TOKEN_IDS} token ids"),
    "suppress_tokens": (lambda v, n: _ids(v, n, MAX_OPTION_IDS), f"a list of at most {MAX_OPTION_IDS} token ids"),
    "begin_suppress_tokens": (lambda v, n: _ids(v, n, MAX_OPTION_IDS),
                              f"a list of at most {MAX_OPTION_IDS} token ids"),
    "logit_bias": (_logit_bias, f"at most {MAX_LOGIT_BIAS} [token id, bias in [-100, 100]] pairs"),
    "structured_output": (_structured, "one of {json_schema: schema}, {json_object: true}, {regex: str}, "
                                       "{grammar: Lark text}"),
}


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def check_option(name: str, value: Any, vocab_size: int | None, where: str, request_id: str | None) -> Any:
    """Option `name`'s value in SamplingParams' form, or RequestRejected (bad_field) naming it, why, and what it
    must be. `vocab_size` None: ids are not checked against the vocabulary; `where` names the request or config."""
    normalise, allowed = OPTION_CHECKS[name]
    try:
        return normalise(value, vocab_size)
    except BadOption as e:
        raise RequestRejected(f"{where}: {name}={shown(value)} is refused ({e}); {name} must be {allowed}",
                              Code.BAD_FIELD, request_id) from None


def check_forced_not_suppressed(forced_bos: int | None, forced_eos: tuple[int, ...], suppressed: tuple[int, ...],
                                where: str, request_id: str | None) -> None:
    """RequestRejected when every forced token is also suppressed (as transformers' GenerationConfig.validate)."""
    for name, forced in (("forced_bos_token_id", () if forced_bos is None else (forced_bos,)),
                         ("forced_eos_token_id", forced_eos)):
        if suppressed and forced and set(forced) <= set(suppressed):
            raise RequestRejected(f"{where}: every token of {name} {sorted(forced)} is also in suppress_tokens; "
                                  f"{name} must leave a token that is not suppressed", Code.BAD_FIELD, request_id)
