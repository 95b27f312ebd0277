"""Checks on what users send, before anything runs: every problem is a RequestRejected (a ValueError) naming
the request, with the wire code that says what is wrong."""

from __future__ import annotations

from typing import Any

from cluster.config import DEFAULT_MAX_NEW_TOKENS
from cluster.errors import Code, RequestRejected
from driver.request import Request, SamplingParams

SAMPLING_KWARGS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed")
# GenerationConfig fields that would need a logits processor Lockstep does not have
UNSUPPORTED_PROCESSORS = ("min_length", "min_new_tokens", "no_repeat_ngram_size", "bad_words_ids", "force_words_ids",
                          "typical_p", "epsilon_cutoff", "eta_cutoff", "min_p", "diversity_penalty",
                          "encoder_repetition_penalty", "exponential_decay_length_penalty", "suppress_tokens",
                          "begin_suppress_tokens", "sequence_bias", "guidance_scale", "renormalize_logits",
                          "forced_bos_token_id", "forced_eos_token_id", "num_beams", "num_return_sequences")


def check_prompt(input_ids: Any, request_id: str, vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt as a list of ints, or ValueError naming the request and the problem."""
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
    return list(input_ids)


def check_max_new_tokens(value: Any, request_id: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRejected(f"request {request_id}: max_new_tokens must be an integer, got {value!r}",
                              Code.BAD_MAX_NEW_TOKENS, request_id)
    if value < 1:
        raise RequestRejected(f"request {request_id}: max_new_tokens={value}; it must be at least 1",
                              Code.BAD_MAX_NEW_TOKENS, request_id)
    return value


def default_max_new_tokens(generation_config: Any) -> int:
    value = getattr(generation_config, "max_new_tokens", None)
    return value if value is not None else DEFAULT_MAX_NEW_TOKENS


def eos_set(eos: Any) -> frozenset[int]:
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def sampling_from(generation_config: Any) -> SamplingParams:
    g = generation_config
    return SamplingParams(do_sample=bool(getattr(g, "do_sample", False)),
                          temperature=float(getattr(g, "temperature", None) or 1.0),
                          top_k=int(getattr(g, "top_k", None) or 0), top_p=float(getattr(g, "top_p", None) or 1.0),
                          repetition_penalty=float(getattr(g, "repetition_penalty", None) or 1.0))


def build_request(manager: Any, input_ids: Any, request_id: str, max_new_tokens: int | None, streaming: bool,
                  record_timestamps: bool, eos_token_id: Any, kwargs: dict[str, Any],
                  strict_processors: bool = False) -> Request:
    """A validated Request from add_request's arguments and the manager's generation config."""
    rc, gen = manager.effective_config, manager.generation_config
    prompt = check_prompt(input_ids, request_id, manager.model.config.vocab_size, rc.max_model_len)
    mnt = check_max_new_tokens(default_max_new_tokens(gen) if max_new_tokens is None else max_new_tokens,
                               request_id)
    if len(prompt) + mnt > rc.max_model_len:
        raise RequestRejected(f"request {request_id}: max_new_tokens={mnt} with a prompt of {len(prompt)} tokens "
                              f"goes beyond the model's context of {rc.max_model_len}", Code.BAD_MAX_NEW_TOKENS,
                              request_id)
    unknown = set(kwargs) - set(SAMPLING_KWARGS)
    if unknown:
        raise RequestRejected(f"request {request_id}: unknown generation parameter(s) {sorted(unknown)}",
                              Code.BAD_FIELD, request_id)
    sampling = sampling_from(gen)
    if kwargs.get("seed") is not None:
        sampling.seed = kwargs["seed"]
    processors = {k: v for k, v in kwargs.items() if k != "seed"}
    if processors and manager.config.per_request_processors:
        for k, v in processors.items():
            setattr(sampling, k, v)
    elif processors and strict_processors:
        raise RequestRejected(f"request {request_id}: sampling parameters {sorted(processors)} need "
                              f"per_request_processors = true in the server's [continuous_batching] preset",
                              Code.UNSUPPORTED, request_id)
    elif processors:
        import warnings
        warnings.warn(f"request {request_id}: {sorted(processors)} ignored: per-request processor parameters "
                      f"need ContinuousBatchingConfig(per_request_processors=True)", stacklevel=3)
    if sampling.temperature <= 0 and sampling.do_sample:
        raise RequestRejected(f"request {request_id}: temperature must be > 0 when sampling", Code.BAD_FIELD,
                              request_id)
    eos = eos_set(eos_token_id if eos_token_id is not None else getattr(gen, "eos_token_id", None))
    return Request(request_id=request_id, prompt_ids=prompt, max_new_tokens=mnt, eos_token_ids=eos,
                   sampling=sampling, streaming=streaming, record_timestamps=record_timestamps,
                   return_logprobs=manager.config.return_logprobs)


def unsupported_processors(generation_config: Any) -> list[str]:
    """The GenerationConfig fields set away from their defaults that Lockstep cannot honour."""
    from transformers import GenerationConfig

    default = GenerationConfig()
    return [name for name in UNSUPPORTED_PROCESSORS
            if getattr(generation_config, name, None) not in (None, getattr(default, name, None))]


def supported_generation_config(generation_config: Any, drop: bool) -> Any:
    """`generation_config` without unsupported processors (drop=True, with a warning), or ValueError."""
    import copy
    import warnings

    from transformers import GenerationConfig

    names = unsupported_processors(generation_config)
    if not names:
        return generation_config
    if not drop:
        raise ValueError(f"generation_config sets {names}, which Lockstep does not support "
                         f"(drop_unsupported_processors=False)")
    warnings.warn(f"dropping unsupported generation settings {names} (drop_unsupported_processors=True)",
                  stacklevel=3)
    cleaned = copy.deepcopy(generation_config)
    default = GenerationConfig()
    for name in names:
        setattr(cleaned, name, getattr(default, name, None))
    return cleaned
