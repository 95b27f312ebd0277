"""TRL's `trl vllm-serve` bodies and answers, field for field as TRL 1.10.0.dev0 defines them (huggingface/trl at
f2cd577, trl/scripts/vllm_serve.py: GenerateRequest, ChatRequest, SequenceLogprobsRequest and their responses; what
trl/generation/vllm_client.py's VLLMClient sends and reads), mapped to Lockstep submits. Pure functions of bodies and
Lockstep outputs, tested in process (tests/test_trl_shape.py); the routes are launch/gateway/trl_routes.py.

Logprobs are vLLM's `processed_logprobs` whatever the preset says, as TRL's server sets vLLM's engine
(`logprobs_mode="processed_logprobs"`, so temperature and the filters shape its importance ratios). Torch-free."""

from __future__ import annotations

import json
import re
from array import array
from base64 import b64encode
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cluster.errors import Code
from cluster.outputs import GenerationOutput
from cluster.protocol import MAX_TOP_LOGPROBS
from cluster.samples import MAX_SAMPLES
from launch.gateway.echo_logprobs import finite
from launch.gateway.errors import HttpError
from launch.gateway.stop_tokens import eos_ids

TRL_VERSION = "1.10.0.dev0"  # huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# vLLM's StructuredOutputsParams keys Lockstep honours -> the wire's structured_output kinds (choice: a regex)
STRUCTURED = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "json_object": "json_object"}


class TrlSampling(BaseModel):
    """The sampling fields TRL's GenerateRequest and ChatRequest share, with TRL's server's defaults (its client
    sends top_k 0; both 0 and -1 are vLLM's no top-k)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    repetition_penalty: float = Field(1.0, gt=0.0)
    temperature: float = Field(1.0, ge=0.0)  # 0 is greedy, as in vLLM
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(16, ge=1, le=INT64_MAX)
    logprobs: int | None = Field(0, ge=0, le=MAX_TOP_LOGPROBS)  # None: no logprobs; k: the top k and the chosen one


class VllmSampling(TrlSampling):
    """vLLM's SamplingParams as TRL's server builds them (its fields, then `generation_kwargs` over them): the ones
    Lockstep honours; text formatting is accepted and ignored (TRL answers token ids); any other is `unsupported`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    structured_outputs: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True


def validated(model: type[BaseModel], data: Any, where: str = "") -> Any:
    """`model` of `data`, or HttpError naming the first bad field (`where` before it): a field the model does not
    know is `unsupported`, a bad value `bad_field`."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = where + ".".join(str(x) for x in first["loc"])
        unknown = first["type"] == "extra_forbidden"
        raise HttpError(Code.UNSUPPORTED if unknown else Code.BAD_FIELD,
                        f"{param} is not supported" if unknown else f"{param}: {first['msg']}", param) from None


class TrlBody(TrlSampling):
    structured_outputs_regex: str | None = None
    generation_kwargs: dict[str, Any] = Field(default_factory=dict)

    def sampling(self) -> VllmSampling:
        """The SamplingParams TRL's server would build: these fields, `generation_kwargs` over them."""
        fields = self.model_dump(include=set(TrlSampling.model_fields))
        return validated(VllmSampling, fields | self.generation_kwargs, "generation_kwargs.")


class GenerateRequest(TrlBody):
    """POST /generate/: text prompts or token id prompts; `images` only as nulls (text-only models here)."""

    prompts: list[str] | list[list[int]]
    images: list[list[str] | None] | None = None

    def sources(self) -> list[dict[str, Any]]:
        if any(images is not None for images in self.images or []):
            raise HttpError(Code.UNSUPPORTED, "images are not supported (text-only models)", "images")
        return [{"text": p} if isinstance(p, str) else {"input_ids": list(p)} for p in self.prompts]


class ChatRequest(TrlBody):
    """POST /chat/: a list of conversations, each rendered with the checkpoint's chat template."""

    messages: list[list[dict[str, Any]]]
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """vLLM's LLM.chat keywords: a generation prompt, the tools, then the caller's chat_template_kwargs."""
        return {"add_generation_prompt": True} | ({"tools": self.tools} if self.tools else {}) \
            | self.chat_template_kwargs


class SequenceLogprobsRequest(BaseModel):
    """POST /get_sequence_logprobs/: each sequence's logprobs after its prompt, from its prefill (prompt logprobs).
    `temperature` is accepted and not applied: TRL's server passes it to vLLM, whose prompt logprobs are the raw
    model's (vLLM PR 37082 proposes a separate prompt_logprobs_temperature); Lockstep's are the raw model's too."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    sequences: list[list[int]]
    prompt_lengths: list[int]
    top_logprobs: int = 100  # TRL's default; vLLM's (and Lockstep's) limit is 20: ask for fewer
    temperature: float = Field(1.0, gt=0.0)
    response_format: str = "json"  # "binary": base64 arrays; anything else: nested lists (TRL's reading)

    def check(self) -> None:
        if len(self.sequences) != len(self.prompt_lengths):
            raise HttpError(Code.BAD_FIELD, "sequences and prompt_lengths must have the same length",
                            "prompt_lengths")
        for i, (seq, length) in enumerate(zip(self.sequences, self.prompt_lengths)):
            if not 0 <= length <= len(seq):
                raise HttpError(Code.BAD_FIELD, f"sequence {i} has prompt_length={length}, outside [0, {len(seq)}]",
                                "prompt_lengths")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise HttpError(Code.BAD_FIELD, f"top_logprobs={self.top_logprobs}; it must be in [0, "
                                            f"{MAX_TOP_LOGPROBS}] (vLLM's max_logprobs default is 20 too)",
                            "top_logprobs")


def structured_output(s: VllmSampling, regex: str | None) -> dict[str, Any] | None:
    """The wire's structured_output: TRL's structured_outputs_regex, which wins (as in TRL), else vLLM's
    structured_outputs (json, regex, grammar (Lark, llguidance's syntax), json_object, choice)."""
    if regex is not None:
        return {"regex": regex}
    spec = {k: v for k, v in (s.structured_outputs or {}).items() if v not in (None, False)}
    if not spec:
        return None
    unknown = set(spec) - set(STRUCTURED) - {"choice"}
    if unknown or len(spec) > 1:
        name = sorted(unknown)[0] if unknown else sorted(spec)[1]
        raise HttpError(Code.UNSUPPORTED, f"structured_outputs: {name} is not supported (one of "
                                          f"{sorted([*STRUCTURED, 'choice'])})",
                        f"generation_kwargs.structured_outputs.{name}")
    (kind, value), = spec.items()
    param = f"generation_kwargs.structured_outputs.{kind}"
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise HttpError(Code.BAD_FIELD, "structured_outputs.choice must be a list of strings", param)
        return {"regex": "|".join(f"(?:{re.escape(str(c))})" for c in value)}
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise HttpError(Code.BAD_FIELD, f"structured_outputs.json is not JSON: {e}", param) from None
    return {STRUCTURED[kind]: value}


def submit_params(s: VllmSampling, regex: str | None, model_eos: int | list[int] | None) -> dict[str, Any]:
    """The submit keywords of TRL's sampling fields (the prompt and `n` aside)."""
    if s.min_p:
        raise HttpError(Code.UNSUPPORTED, "min_p is not supported (no min-p filter)", "min_p")
    greedy = s.temperature == 0.0
    stops = [s.stop] if isinstance(s.stop, str) else list(s.stop or [])
    params = {"max_new_tokens": s.max_tokens, "do_sample": not greedy, "temperature": None if greedy else
              s.temperature, "top_p": s.top_p if s.top_p < 1.0 else None, "top_k": s.top_k if s.top_k > 0 else None,
              "seed": s.seed, "stop": stops or None, "min_new_tokens": s.min_tokens or None,
              "repetition_penalty": None if s.repetition_penalty == 1.0 else s.repetition_penalty,
              "frequency_penalty": s.frequency_penalty or None, "presence_penalty": s.presence_penalty or None,
              "eos_token_id": eos_ids(model_eos, s.stop_token_ids, s.ignore_eos),
              "structured_output": structured_output(s, regex),
              "logprobs": s.logprobs is not None or None, "top_logprobs": s.logprobs or None,
              "logprobs_mode": "processed_logprobs" if s.logprobs is not None else None}
    return {k: v for k, v in params.items() if v is not None}


def ranked(token: int, logprob: float | None, alternatives: Sequence | None) -> tuple[list, list[int]]:
    """vLLM's logprobs of one position sorted by rank: the most probable tokens, then the token itself where it is
    not among them (logprobs, token ids); NaN is None (as TRL), -inf -9999.0 (JSON has no infinity)."""
    pairs = [(t, lp) for t, lp in alternatives or ()]
    if all(t != token for t, _ in pairs):
        pairs.append((token, logprob))
    return [finite(lp) for _, lp in pairs], [t for t, _ in pairs]


def completions_answer(groups: list[list[GenerationOutput]], logprobs: bool) -> dict[str, Any]:
    """GenerateResponse (and ChatResponse): one prompt_ids a prompt; its n completions next to each other, prompts
    in order; per completion token its ranked logprobs (None when the call asked none)."""
    outs = [o for group in groups for o in group]
    answer: dict[str, Any] = {"prompt_ids": [list(g[0].prompt_ids) for g in groups],
                              "completion_ids": [list(o.generated_tokens) for o in outs],
                              "logprobs": None, "logprob_token_ids": None}
    if logprobs:
        ranks = [[ranked(t, o.logprobs[i], o.top_logprobs[i] if o.top_logprobs else None)
                  for i, t in enumerate(o.generated_tokens)] for o in outs]
        answer["logprobs"] = [[lp for lp, _ in seq] for seq in ranks]
        answer["logprob_token_ids"] = [[ids for _, ids in seq] for seq in ranks]
    return answer


BINARY_FIELDS = ("logprobs_b64", "token_ids_b64", "actual_logprobs_b64", "actual_token_ids_b64", "shape",
                 "completion_lengths")


def sequence_logprobs_json(outs: list[GenerationOutput], prompt_lengths: list[int]) -> dict[str, Any]:
    """SequenceLogprobsResponse, `json`: per sequence, per token after its prompt, the ranked logprobs (the top k
    and the token itself); a position with none (the first) has empty lists."""
    logprobs, token_ids = [], []
    for out, start in zip(outs, prompt_lengths):
        ranks = [ranked(out.prompt_ids[p], out.prompt_logprobs[p], out.prompt_top_logprobs[p])
                 if out.prompt_logprobs[p] is not None else ([], []) for p in range(start, len(out.prompt_ids))]
        logprobs.append([lp for lp, _ in ranks])
        token_ids.append([ids for _, ids in ranks])
    return {"logprobs": logprobs, "logprob_token_ids": token_ids} | dict.fromkeys(BINARY_FIELDS)


def sequence_logprobs_binary(outs: list[GenerationOutput], prompt_lengths: list[int], top_k: int) -> dict[str, Any]:
    """SequenceLogprobsResponse, `binary`: base64 native-order float32 and int32 arrays of shape [sequences, the
    longest completion, top_k] (the top k; padding -inf and 0) and [.., 1] (the token's own), as TRL's server
    writes them with numpy."""
    lengths = [len(o.prompt_ids) - start for o, start in zip(outs, prompt_lengths)]
    width = max(lengths, default=0)
    cells = len(outs) * width
    top = array("f", [float("-inf")]) * (cells * top_k)
    top_ids = array("i", [0]) * (cells * top_k)
    actual = array("f", [float("-inf")]) * cells
    actual_ids = array("i", [0]) * cells
    for i, (out, start) in enumerate(zip(outs, prompt_lengths)):
        for p in range(start, len(out.prompt_ids)):
            if out.prompt_logprobs[p] is None:
                continue
            cell = i * width + p - start
            actual_ids[cell] = out.prompt_ids[p]
            if out.prompt_logprobs[p] == out.prompt_logprobs[p]:  # not NaN
                actual[cell] = out.prompt_logprobs[p]
            for k, (token, lp) in enumerate(list(out.prompt_top_logprobs[p])[:top_k]):
                top_ids[cell * top_k + k] = token
                if lp == lp:
                    top[cell * top_k + k] = lp
    encoded = [b64encode(a.tobytes()).decode("ascii") for a in (top, top_ids, actual, actual_ids)]
    return dict(zip(BINARY_FIELDS, [*encoded, [len(outs), width, top_k], lengths]))
