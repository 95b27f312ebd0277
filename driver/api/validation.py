"""Checks on what users send, before anything runs: every problem is a RequestRejected (a ValueError) naming
the request, with the wire code that says what is wrong."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

from cluster.config import DEFAULT_MAX_NEW_TOKENS, LOGPROBS_MODES
from cluster.errors import Code, RequestRejected
from cluster.protocol import (MAX_EOS_TOKEN_IDS, MAX_REQUEST_ID_CHARS, MAX_TOP_LOGPROBS, PRIORITY_MAX, PRIORITY_MIN,
                              SAMPLING_FIELDS)
from driver.api.option_checks import OPTION_CHECKS, check_forced_not_suppressed, check_option, integer, real, shown
from driver.api.request_group import samples_asked
from driver.engine.request import Request, ResumedRequest, SamplingParams
from worker.rope import exact_prompt_limit

SAMPLING_KWARGS = tuple(SAMPLING_FIELDS)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# GenerationConfig fields that would need a logits processor (or a search) Lockstep does not have
UNSUPPORTED_PROCESSORS = ("force_words_ids", "constraints", "typical_p", "epsilon_cutoff", "eta_cutoff", "min_p",
                          "top_h", "diversity_penalty", "encoder_repetition_penalty", "encoder_no_repeat_ngram_size",
                          "exponential_decay_length_penalty", "guidance_scale", "renormalize_logits",
                          "remove_invalid_values", "watermarking_config", "num_beams")


def check_prompt(input_ids: Any, request_id: str, vocab_size: int, max_model_len: int,
                 exact_limit: int | None = None) -> list[int]:
    """The prompt as a list of ints, or ValueError naming the request and the problem. `exact_limit`: the longest
    prompt the model serves token-identically to transformers (worker/rope.py `exact_prompt_limit`), if any."""
    if hasattr(input_ids, "tolist"):
        input_ids = input_ids.tolist()
    if not isinstance(input_ids, (list, tuple)):
        raise RequestRejected(f"request {request_id}: input_ids must be a list of token ids, "
                              f"got {type(input_ids).__name__}", Code.BAD_FIELD, request_id)
    if len(input_ids) == 0:
        raise RequestRejected(f"request {request_id}: the prompt is empty", Code.EMPTY_PROMPT, request_id)
    for i, t in enumerate(input_ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestRejected(f"request {request_id}: token {i} is {t!r}, not an integer id", Code.BAD_FIELD,
                                  request_id)
        if not 0 <= t < vocab_size:
            raise RequestRejected(f"request {request_id}: token id {t} at position {i} is outside the "
                                  f"vocabulary [0, {vocab_size})", Code.TOKEN_OUT_OF_VOCAB, request_id)
    if len(input_ids) >= max_model_len:
        raise RequestRejected(f"request {request_id}: the prompt has {len(input_ids)} tokens; the model's context "
                              f"is {max_model_len}, which leaves no room for a new token", Code.PROMPT_TOO_LONG,
                              request_id)
    if exact_limit is not None and len(input_ids) > exact_limit:
        raise RequestRejected(f"request {request_id}: the prompt has {len(input_ids)} tokens; this model's longrope "
                              f"rotary equals transformers' only for prompts of up to {exact_limit} tokens "
                              f"(original_max_position_embeddings: a longer prompt is rotated with the long factors "
                              f"throughout; docs/models.md, \"RoPE\")", Code.PROMPT_TOO_LONG, request_id)
    return list(input_ids)


def _top_k(v: Any) -> int | None:
    k = integer(v)
    return None if k is None or k < -1 else (0 if k == -1 else k)  # 0 and -1 both mean no top-k


def _seed(v: Any) -> int | None:
    s = integer(v)
    return s if s is not None and INT64_MIN <= s <= INT64_MAX else None


def _in(test: Callable[[float], bool]) -> Callable[[Any], float | None]:
    def check(v: Any) -> float | None:
        x = real(v)
        return x if x is not None and test(x) else None
    return check


# parameter -> (normaliser returning the value to use, or None when the value is refused; the allowed range)
SAMPLING_RANGES: dict[str, tuple[Callable[[Any], Any], str]] = {
    "do_sample": (lambda v: v if isinstance(v, bool) else None, "true or false"),
    "temperature": (_in(lambda x: math.isfinite(x) and x >= 0), "a finite number >= 0 (> 0 when sampling)"),
    "top_k": (_top_k, "an integer >= 1, or 0 or -1 for no top-k"),
    "top_p": (_in(lambda x: 0 < x <= 1), "a number in (0, 1]"),
    "repetition_penalty": (_in(lambda x: math.isfinite(x) and x > 0), "a finite number > 0"),
    "seed": (_seed, "an integer in [-2**63, 2**63 - 1]"),
    "presence_penalty": (_in(lambda x: -2 <= x <= 2), "a number in [-2, 2]"),
    "frequency_penalty": (_in(lambda x: -2 <= x <= 2), "a number in [-2, 2]"),
}


def _where(request_id: str | None) -> str:
    return f"request {request_id}" if request_id is not None else "generation_config"


def check_sampling_value(name: str, value: Any, request_id: str | None, vocab_size: int | None = None) -> Any:
    """The value to use for sampling parameter or generation option `name`, or RequestRejected (bad_field) naming
    it and its range. `request_id` None: from the generation config; `vocab_size` None: ids are not checked yet."""
    if name in OPTION_CHECKS:
        return check_option(name, value, vocab_size, _where(request_id), request_id)
    normalise, allowed = SAMPLING_RANGES[name]
    checked = normalise(value)
    if checked is None:
        raise RequestRejected(f"{_where(request_id)}: {name}={shown(value)} is out of range; {name} must be "
                              f"{allowed}", Code.BAD_FIELD, request_id)
    return checked


def check_combination(sampling: SamplingParams, request_id: str | None) -> None:
    """The checks that read several parameters: temperature > 0 when sampling; a forced token not suppressed."""
    if sampling.do_sample and sampling.temperature <= 0:
        raise RequestRejected(f"{_where(request_id)}: temperature={sampling.temperature!r} with do_sample=True; "
                              f"temperature must be {SAMPLING_RANGES['temperature'][1]}", Code.BAD_FIELD, request_id)
    check_forced_not_suppressed(sampling.forced_bos_token_id, sampling.forced_eos_token_id, sampling.suppress_tokens,
                                _where(request_id), request_id)


def sampling_from(generation_config: Any, vocab_size: int | None = None) -> SamplingParams:
    """The sampling defaults and options a GenerationConfig sets, checked (ids against `vocab_size` when given)."""
    values = {name: getattr(generation_config, name, None) for name in SAMPLING_KWARGS if name != "seed"}
    sampling = SamplingParams(**{k: check_sampling_value(k, v, None, vocab_size) for k, v in values.items()
                                 if v is not None})
    check_combination(sampling, None)
    return sampling


def check_request_id(request_id: Any) -> str:
    if not isinstance(request_id, str):
        raise RequestRejected(f"request_id must be a string, got {type(request_id).__name__}", Code.BAD_FIELD)
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise RequestRejected(f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are "
                              f"allowed", Code.BAD_FIELD)
    return request_id


def check_priority(priority: Any, request_id: str) -> int:
    """A request's scheduling priority (lower first): an integer in [PRIORITY_MIN, PRIORITY_MAX], else bad_field."""
    p = integer(priority)
    if p is None or not PRIORITY_MIN <= p <= PRIORITY_MAX:
        raise RequestRejected(f"request {request_id}: priority={shown(priority)}; priority must be an integer in "
                              f"[{PRIORITY_MIN}, {PRIORITY_MAX}] (lower is served first)", Code.BAD_FIELD, request_id)
    return p


def check_top_logprobs(top: Any, request_id: str) -> int:
    """How many of each token's most probable alternatives to report: an integer in [0, MAX_TOP_LOGPROBS]."""
    k = integer(top)
    if k is None or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise RequestRejected(f"request {request_id}: top_logprobs={shown(top)}; top_logprobs must be an integer in "
                              f"[0, {MAX_TOP_LOGPROBS}]", Code.BAD_FIELD, request_id)
    return k


def check_prompt_logprobs(k: Any, request_id: str) -> int | None:
    """vLLM's `prompt_logprobs`: None (not asked) or an integer in [0, MAX_TOP_LOGPROBS] (the most probable tokens
    reported at each prompt position; 0: the prompt token's logprob alone)."""
    if k is None:
        return None
    n = integer(k)
    if n is None or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise RequestRejected(f"request {request_id}: prompt_logprobs={shown(k)}; prompt_logprobs must be an "
                              f"integer in [0, {MAX_TOP_LOGPROBS}]", Code.BAD_FIELD, request_id)
    return n


NO_EOS = -1  # transformers' placeholder for "no EOS token" (the benchmarks send it): accepted, matches nothing


def check_eos(eos: Any, request_id: str, vocab_size: int) -> frozenset[int]:
    """A request's eos_token_id (an id or a list of at most MAX_EOS_TOKEN_IDS, or NO_EOS) as a set."""
    ids = [eos] if integer(eos) is not None else eos
    if not isinstance(ids, (list, tuple)) or any(integer(e) is None for e in ids):
        raise RequestRejected(f"request {request_id}: eos_token_id must be a token id or a list of token ids",
                              Code.BAD_FIELD, request_id)
    if len(ids) > MAX_EOS_TOKEN_IDS:
        raise RequestRejected(f"request {request_id}: eos_token_id lists {len(ids)} ids; at most "
                              f"{MAX_EOS_TOKEN_IDS} are allowed", Code.BAD_FIELD, request_id)
    ids = [int(e) for e in ids if int(e) != NO_EOS]
    bad = [e for e in ids if not 0 <= e < vocab_size]
    if bad:
        raise RequestRejected(f"request {request_id}: eos_token_id {bad[0]} is not a token id: eos_token_id must "
                              f"be in [0, {vocab_size}) (or {NO_EOS} for none)", Code.BAD_FIELD, request_id)
    return frozenset(ids)


def check_fits_cache(prompt_len: int, max_new_tokens: int, request_id: str, rc: Any) -> None:
    """RequestRejected (exceeds_kv_cache) for a request that could not finish even alone in the whole cache (the
    pages it holds at its longest: the last sampled token is never fed back, so its K/V never exists)."""
    need = -(-(prompt_len + max_new_tokens - 1) // rc.page_size)
    if need > rc.num_blocks:
        raise RequestRejected(f"request {request_id}: a prompt of {prompt_len} tokens and up to {max_new_tokens} new "
                              f"ones need {need} KV pages of {rc.page_size} tokens; the whole cache holds "
                              f"{rc.num_blocks}", Code.EXCEEDS_KV_CACHE, request_id)


MAX_RESUMES = 1 << 20  # the largest `resumes` count a request may carry


def check_resume(tokens: Any, versions: Any, resumes: Any, request_id: str, vocab_size: int, max_new_tokens: int,
                 eos: frozenset[int]) -> tuple[list[int], list[tuple[int, int]], int]:
    """A resume's delivered tokens, their compact weight versions and the resume count, checked: tokens in the
    vocabulary, fewer than max_new_tokens and none an EOS (the request would have ended there); versions as
    (index, version) pairs, the first at index 0, indices increasing and inside the tokens."""
    def bad(what: str) -> RequestRejected:
        return RequestRejected(f"request {request_id}: {what}", Code.BAD_FIELD, request_id)

    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    tokens = list(tokens or [])
    for i, t in enumerate(tokens):
        if integer(t) is None:
            raise bad(f"resume_tokens[{i}] is {t!r}, not an integer id")
        if not 0 <= t < vocab_size:
            raise RequestRejected(f"request {request_id}: resume_tokens[{i}]={t} is outside the vocabulary "
                                  f"[0, {vocab_size})", Code.TOKEN_OUT_OF_VOCAB, request_id)
        if t in eos:
            raise bad(f"resume_tokens[{i}]={t} is an EOS token: the request ended there")
    if len(tokens) >= max_new_tokens:
        raise bad(f"{len(tokens)} resume_tokens with max_new_tokens={max_new_tokens}: a resume must leave at least "
                  f"one token to generate")
    pairs: list[tuple[int, int]] = []
    for p in list(versions or []):
        if not (isinstance(p, (list, tuple)) and len(p) == 2 and all(integer(x) is not None and x >= 0 for x in p)):
            raise bad("resume_versions must be [index, version] pairs of non-negative integers")
        if (not pairs and p[0] != 0) or (pairs and p[0] <= pairs[-1][0]) or p[0] >= len(tokens):
            raise bad("resume_versions: the first index is 0, indices increase and stay below len(resume_tokens)")
        pairs.append((int(p[0]), int(p[1])))
    count = integer(resumes)
    if count is None or not 0 <= count <= MAX_RESUMES:
        raise bad(f"resumes={resumes!r}; it must be an integer in [0, {MAX_RESUMES}]")
    return tokens, pairs, max(count, 1 if tokens else 0)


def build_request(manager: Any, input_ids: Any, request_id: str, max_new_tokens: int | None, streaming: bool,
                  record_timestamps: bool, eos_token_id: Any, kwargs: dict[str, Any],
                  strict_processors: bool = False, resume_tokens: Any = None, resume_versions: Any = None,
                  resumes: Any = 0, priority: Any = 0, top_logprobs: Any = 0, prompt_logprobs: Any = None,
                  logprobs_mode: Any = None, speculative: Any = True) -> Request:
    """A validated Request from add_request's arguments and the manager's generation config; with `resume_tokens`
    (or `resumes` > 0) a ResumedRequest, whose `max_new_tokens` counts the resumed tokens too. `top_logprobs` > 0:
    each token's most probable alternatives too (with the logprobs). `prompt_logprobs` (vLLM's): the prompt's own
    logprobs with that many alternatives (driver/engine/prompt_scores.py). `logprobs_mode` (vLLM's; None: the
    config's): what its logprobs report (driver/engine/logprobs_mode.py). `speculative=False`: it never speculates
    (docs/speculative.md)."""
    rc, gen = manager.effective_config, manager.generation_config
    request_id = check_request_id(request_id)
    if not isinstance(speculative, bool):
        raise RequestRejected(f"request {request_id}: speculative={shown(speculative)}; it must be true or false",
                              Code.BAD_FIELD, request_id)
    priority = check_priority(priority, request_id)
    top = check_top_logprobs(top_logprobs, request_id)
    scores = check_prompt_logprobs(prompt_logprobs, request_id)
    mode = manager.config.logprobs_mode if logprobs_mode is None else logprobs_mode
    if mode not in LOGPROBS_MODES:
        raise RequestRejected(f"request {request_id}: logprobs_mode={shown(mode)}; it must be one of "
                              f"{', '.join(LOGPROBS_MODES)}", Code.BAD_FIELD, request_id)
    vocab = manager.model.config.vocab_size
    prompt = check_prompt(input_ids, request_id, vocab, rc.max_model_len, exact_prompt_limit(manager.model.config))
    if max_new_tokens is None:
        max_new_tokens = getattr(gen, "max_new_tokens", None)
    mnt = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    if isinstance(mnt, bool) or not isinstance(mnt, int) or mnt < 1:
        raise RequestRejected(f"request {request_id}: max_new_tokens={mnt!r}; it must be an integer of at least 1",
                              Code.BAD_MAX_NEW_TOKENS, request_id)
    if len(prompt) + mnt > rc.max_model_len:
        raise RequestRejected(f"request {request_id}: max_new_tokens={mnt} with a prompt of {len(prompt)} tokens "
                              f"goes beyond the model's context of {rc.max_model_len}", Code.BAD_MAX_NEW_TOKENS,
                              request_id)
    check_fits_cache(len(prompt), mnt, request_id, rc)
    unknown = set(kwargs) - set(SAMPLING_KWARGS)
    if unknown:
        raise RequestRejected(f"request {request_id}: unknown generation parameter(s) {sorted(unknown)}",
                              Code.BAD_FIELD, request_id)
    params = {k: check_sampling_value(k, v, request_id, vocab) for k, v in kwargs.items() if v is not None}
    sampling = sampling_from(gen, vocab)
    if "seed" in params:
        sampling.seed = params["seed"]
    processors = {k: v for k, v in params.items() if k != "seed"}
    if processors and manager.config.per_request_processors:
        for k, v in processors.items():
            setattr(sampling, k, v)
    elif processors and strict_processors:
        raise RequestRejected(f"request {request_id}: sampling parameters {sorted(processors)} need "
                              f"per_request_processors = true in the server's [continuous_batching] preset",
                              Code.UNSUPPORTED, request_id)
    elif processors:
        warnings.warn(f"request {request_id}: {sorted(processors)} ignored: per-request processor parameters "
                      f"need ContinuousBatchingConfig(per_request_processors=True)", stacklevel=3)
    check_combination(sampling, request_id)
    if eos_token_id is not None:
        eos = check_eos(eos_token_id, request_id, vocab)
    else:
        eos = getattr(gen, "eos_token_id", None)
        eos = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
    grammar = structured_state(manager, sampling, eos, request_id)
    if grammar is not None:  # a complete grammar allows only EOS: it ends the request, ignore_eos or not
        eos = eos | grammar.eos
    common = dict(request_id=request_id, eos_token_ids=eos, sampling=sampling, streaming=streaming,
                  record_timestamps=record_timestamps, return_logprobs=manager.config.return_logprobs or top > 0,
                  num_top_logprobs=top, priority=priority, grammar=grammar, prompt_logprobs=scores,
                  logprobs_mode=mode, speculative=speculative)
    tokens, versions, count = check_resume(resume_tokens, resume_versions, resumes, request_id, vocab, mnt, eos)
    if not count:
        return Request(prompt_ids=prompt, max_new_tokens=mnt, **common)
    if scores is not None:
        raise RequestRejected(f"request {request_id}: prompt_logprobs with resumed tokens is not supported (the "
                              f"resumed prompt is not the client's)", Code.UNSUPPORTED, request_id)
    return ResumedRequest(prompt_ids=prompt + tokens, max_new_tokens=mnt - len(tokens), resumed_tokens=len(tokens),
                          resume_versions=versions, resumes=count, **common)


def structured_state(manager: Any, sampling: SamplingParams, eos: frozenset[int], request_id: str) -> Any:
    """The request's grammar matcher when it asks for a structured output (driver/engine/structured.py), else None."""
    if sampling.structured_output is None:
        return None
    from driver.engine.structured import grammar_state

    try:
        return grammar_state(sampling.structured_output, manager.model.model_dir, manager.model.config.vocab_size,
                             eos)
    except RequestRejected as e:
        raise RequestRejected(f"request {request_id}: {e.message}", e.code, request_id) from None


def supported_generation_config(generation_config: Any, drop: bool) -> Any:
    """`generation_config` without the fields set away from their defaults that Lockstep cannot honour (drop=True,
    with a warning), or ValueError (also for a sampling value out of range)."""
    import copy

    from transformers import GenerationConfig

    sampling_from(generation_config)  # its sampling values are checked once, on every rank, before anything runs
    samples_asked(generation_config)  # and its num_return_sequences (n samples of one prompt: request_group.py)
    default = GenerationConfig()
    names = [name for name in UNSUPPORTED_PROCESSORS
             if getattr(generation_config, name, None) not in (None, getattr(default, name, None))]
    if not names:
        return generation_config
    if not drop:
        raise ValueError(f"generation_config sets {names}, which Lockstep does not support "
                         f"(drop_unsupported_processors=False)")
    warnings.warn(f"dropping unsupported generation settings {names} (drop_unsupported_processors=True)", stacklevel=3)
    cleaned = copy.deepcopy(generation_config)
    for name in names:
        setattr(cleaned, name, getattr(default, name, None))
    return cleaned
