"""SGLang's native `/generate`, shaped as SGLang answers it (its io_struct's GenerateReqInput in, its http_server's
answer out): what slime, AReaL and verl's HTTP adapter read. Pure functions of a request body and Lockstep outputs,
so the shaping is tested in process (tests/test_sglang_shape.py); the routes are launch/gateway/sglang_routes.py.
Torch-free."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cluster.errors import Code
from cluster.outputs import GenerationOutput
from launch.gateway.echo_logprobs import finite
from launch.gateway.errors import HttpError
from launch.gateway.stop_tokens import eos_ids

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default


class SamplingParamsBody(BaseModel):
    """SGLang's sampling_params that Lockstep honours (skip_special_tokens and the like, output formatting, are
    accepted and ignored); any other is refused by name (extra="forbid": a 400 bad_field)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(DEFAULT_MAX_NEW_TOKENS, ge=1)
    temperature: float = Field(1.0, ge=0.0)  # SGLang's default samples; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = None
    repetition_penalty: float = Field(1.0, gt=0.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    min_new_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=1)  # one sample a prompt: list the prompt n times
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None


class GenerateBody(BaseModel):
    """SGLang's GenerateReqInput, the fields Lockstep serves: one prompt or a batch (a list), as text or ids."""

    model_config = ConfigDict(extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsBody | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1  # >= 0: the prompt's logprobs from that position (input_token_logprobs)
    top_logprobs_num: int = Field(0, ge=0, le=20)
    stream: bool = False
    rid: str | list[str] | None = None

    def prompts(self) -> tuple[list[dict[str, Any]], bool]:
        """Each prompt's source ({"text"} or {"input_ids"}) and whether the body was a batch."""
        if (self.text is None) == (self.input_ids is None):
            raise HttpError(Code.BAD_FIELD, "a generate request carries exactly one of text and input_ids", "text")
        if self.text is not None:
            texts = [self.text] if isinstance(self.text, str) else self.text
            return [{"text": t} for t in texts], not isinstance(self.text, str)
        ids = self.input_ids
        batch = bool(ids) and isinstance(ids[0], list)
        return [{"input_ids": list(p)} for p in (ids if batch else [ids])], batch

    def rids(self, count: int, fresh: str) -> list[str]:
        """Each prompt's request id: the caller's `rid`s, else `fresh` numbered."""
        given = [self.rid] if isinstance(self.rid, str) else self.rid
        if given is not None and len(given) != count:
            raise HttpError(Code.BAD_FIELD, f"rid names {len(given)} requests for {count} prompts", "rid")
        return given or [f"{fresh}-{i}" if count > 1 else fresh for i in range(count)]


def submit_params(body: GenerateBody, eos_token_id: int | list[int] | None, text: bool) -> dict[str, Any]:
    """The submit keywords of a generate body (the prompt aside). `eos_token_id`: the model's (stop_token_ids add
    to it, as in SGLang); `text`: there is a tokenizer (outputs carry text)."""
    s = body.sampling_params or SamplingParamsBody()
    if s.stream_interval not in (None, 1) and body.stream:
        raise HttpError(Code.UNSUPPORTED, "stream_interval other than 1 is not supported", "stream_interval")
    stops = [s.stop] if isinstance(s.stop, str) else list(s.stop or [])
    eos = eos_ids(eos_token_id, s.stop_token_ids, s.ignore_eos)
    greedy = s.temperature == 0.0
    params = {"max_new_tokens": s.max_new_tokens, "do_sample": not greedy, "temperature": None if greedy else
              s.temperature, "top_p": s.top_p if s.top_p < 1.0 else None, "top_k": s.top_k if s.top_k > 0 else None,
              "seed": s.sampling_seed, "stop": stops or None, "min_new_tokens": s.min_new_tokens or None,
              "repetition_penalty": None if s.repetition_penalty == 1.0 else s.repetition_penalty,
              "frequency_penalty": s.frequency_penalty or None, "presence_penalty": s.presence_penalty or None,
              "eos_token_id": eos, "return_text": text or None,
              "logprobs": body.return_logprob or None, "top_logprobs": body.top_logprobs_num or None,
              "prompt_logprobs": (body.top_logprobs_num if body.return_logprob and body.logprob_start_len >= 0
                                  else None)}
    return {k: v for k, v in params.items() if v is not None}


def finish_reason(out: GenerationOutput) -> dict[str, Any] | None:
    """SGLang's finish_reason: {type: stop, matched: the stop string or token}, {type: length, length},
    {type: abort, message}; None while it runs."""
    if not out.is_finished():
        return None
    reason = out.finish_reason
    if reason == "stop":
        matched: Any = out.stop_string if out.stop_string else (out.generated_tokens[-1] if out.generated_tokens
                                                                 else None)
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": len(out.generated_tokens)}
    return {"type": "abort", "message": out.error or f"the request ended: {reason}"}


def triples(logprobs: list[float | None], tokens: list[int]) -> list[list[Any]]:
    """SGLang's token logprobs: [logprob, token id, text] (text null: SGLang's return_text_in_logprobs off)."""
    return [[finite(lp), t, None] for lp, t in zip(logprobs, tokens)]


def top_lists(top: list | None) -> list[list[list[Any]]] | None:
    """SGLang's top logprobs: per token, [logprob, token id, null] of its most probable tokens."""
    if top is None:
        return None
    return [[[finite(lp), t, None] for t, lp in alts] for alts in top]


def answer(out: GenerationOutput, body: GenerateBody, weight_label: str, latency_s: float) -> dict[str, Any]:
    """One prompt's SGLang answer: text, output_ids and meta_info (id, finish_reason, prompt and completion
    tokens, cached tokens, weight_version, e2e latency; with return_logprob its output_token_logprobs, and
    input_token_logprobs when logprob_start_len >= 0; top logprobs with top_logprobs_num)."""
    gen = out.generated_tokens
    meta: dict[str, Any] = {"id": out.request_id, "finish_reason": finish_reason(out),
                            "prompt_tokens": len(out.prompt_ids), "completion_tokens": len(gen), "cached_tokens": 0,
                            "weight_version": weight_label, "e2e_latency": latency_s}
    if body.return_logprob:
        meta["output_token_logprobs"] = triples(list(out.logprobs[:len(gen)]), gen)
        if body.top_logprobs_num:
            meta["output_top_logprobs"] = top_lists(out.top_logprobs)
        if body.logprob_start_len >= 0 and out.prompt_logprobs is not None:
            start = body.logprob_start_len
            meta["input_token_logprobs"] = triples(out.prompt_logprobs[start:], out.prompt_ids[start:])
            if body.top_logprobs_num:
                meta["input_top_logprobs"] = [None if i == 0 else [[finite(lp), t, None] for t, lp in alts]
                                              for i, alts in enumerate(out.prompt_top_logprobs or [])][start:]
    return {"text": out.text or "", "output_ids": list(gen), "meta_info": meta}


def memory_tags(tags: list[str] | None) -> list[str]:
    """SGLang's memory tags as Lockstep's (kv_cache, weights); SGLang's cuda_graph has no separate pool here."""
    wanted = tags or ["kv_cache", "weights"]
    unknown = set(wanted) - {"kv_cache", "weights", "cuda_graph"}
    if unknown:
        raise HttpError(Code.BAD_FIELD, f"unknown memory tags {sorted(unknown)}", "tags")
    return [t for t in ("kv_cache", "weights") if t in wanted]
