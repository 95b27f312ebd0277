"""Checks on what users send, before anything runs: every problem is a ValueError naming the request."""

from __future__ import annotations

from typing import Any

from cluster.config import DEFAULT_MAX_NEW_TOKENS
from driver.request import Request, SamplingParams

SAMPLING_KWARGS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed")


def check_prompt(input_ids: Any, request_id: str, vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt as a list of ints, or ValueError naming the request and the problem."""
    if hasattr(input_ids, "tolist"):
        input_ids = input_ids.tolist()
    if not isinstance(input_ids, (list, tuple)):
        raise ValueError(f"request {request_id}: input_ids must be a list of token ids, "
                         f"got {type(input_ids).__name__}")
    if len(input_ids) == 0:
        raise ValueError(f"request {request_id}: the prompt is empty")
    for i, t in enumerate(input_ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"request {request_id}: token {i} is {t!r}, not an integer id")
        if not 0 <= t < vocab_size:
            raise ValueError(f"request {request_id}: token id {t} at position {i} is outside the "
                             f"vocabulary [0, {vocab_size})")
    if len(input_ids) >= max_model_len:
        raise ValueError(f"request {request_id}: the prompt has {len(input_ids)} tokens; the model's context "
                         f"is {max_model_len}, which leaves no room for a new token")
    return list(input_ids)


def check_max_new_tokens(value: Any, request_id: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"request {request_id}: max_new_tokens must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"request {request_id}: max_new_tokens={value}; it must be at least 1")
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
                  record_timestamps: bool, eos_token_id: Any, kwargs: dict[str, Any]) -> Request:
    """A validated Request from add_request's arguments and the manager's generation config."""
    rc, gen = manager.effective_config, manager.generation_config
    prompt = check_prompt(input_ids, request_id, manager.model.config.vocab_size, rc.max_model_len)
    mnt = check_max_new_tokens(default_max_new_tokens(gen) if max_new_tokens is None else max_new_tokens,
                               request_id)
    unknown = set(kwargs) - set(SAMPLING_KWARGS)
    if unknown:
        raise ValueError(f"request {request_id}: unknown generation parameter(s) {sorted(unknown)}")
    sampling = sampling_from(gen)
    if kwargs and manager.config.per_request_processors:
        for k, v in kwargs.items():
            setattr(sampling, k, v)
    elif kwargs.get("seed") is not None:
        sampling.seed = kwargs["seed"]
    if sampling.temperature <= 0 and sampling.do_sample:
        raise ValueError(f"request {request_id}: temperature must be > 0 when sampling")
    eos = eos_set(eos_token_id if eos_token_id is not None else getattr(gen, "eos_token_id", None))
    return Request(request_id=request_id, prompt_ids=prompt, max_new_tokens=mnt, eos_token_ids=eos,
                   sampling=sampling, streaming=streaming, record_timestamps=record_timestamps,
                   return_logprobs=manager.config.return_logprobs)
