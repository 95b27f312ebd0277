"""OpenAI's request bodies (pydantic) and what each asks of a Lockstep submit. Unknown fields are ignored, as
OpenAI-compatible servers do; a value out of its range is refused with `bad_field` naming the field, and known
fields this server cannot honour with `unsupported` (docs/http.md lists every field). Torch-free."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.errors import Code
from cluster.protocol import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, PRIORITY_MAX, PRIORITY_MIN
from cluster.samples import MAX_SAMPLES
from launch.gateway.errors import HttpError

MAX_N = MAX_SAMPLES  # choices per prompt: its samples, one submit with `n` (cluster/samples.py)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # what the wire's integers hold
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar"}  # vLLM's fields


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # accepted: the output always follows the schema (a token mask, not a hint)


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever EOS says (benchmarks)
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)  # vLLM's extension: lower is scheduled first
    # Lockstep's: the weight versions a request may span, and what an update beyond does (docs/weights.md, "Staleness")
    max_weight_lag: int | None = Field(None, ge=0)
    stale_policy: Literal["end", "restart"] | None = None
    speculative: bool = True  # Lockstep's: false keeps it out of speculative decoding (docs/speculative.md)
    # vLLM's: what logprobs report (vLLM's engine setting, per request here; unset: the preset's, docs/http.md), and
    # each choice's prompt_token_ids and token_ids
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits"] | None = None
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's extensions: a JSON schema, a regex, a Lark grammar
    guided_regex: str | None = None
    guided_grammar: str | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:  # the wire's limit, refused here with the field named
            raise HttpError(Code.BAD_FIELD, f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
        return stops

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not token.isdigit() or not -100 <= value <= 100:
                raise ValueError(f"logit_bias maps token ids to biases in [-100, 100], got {token!r}: {value!r}")
        return bias

    @model_validator(mode="after")
    def _stream_options(self) -> "_Common":
        if self.stream_options is not None and not self.stream:
            raise HttpError(Code.BAD_FIELD, "stream_options can only be set when stream is true", "stream_options")
        return self

    def check_supported(self) -> None:
        """HttpError (unsupported) for a field this server cannot honour."""

    def named(self, error: HttpError) -> HttpError:
        """`error` with `param` the field that set the structured output, when the driver refused that
        (its message names the wire's `structured_output`: launch/gateway/errors.py maps it to response_format)."""
        if error.param == "response_format":
            error.param = next((n for n in GUIDED if getattr(self, n) is not None), error.param)
        return error

    def structured_output(self) -> dict[str, Any] | None:
        """The wire's `structured_output` spec (driver/engine/structured.py) of response_format or vLLM's guided_*
        fields (at most one of them), None for plain text."""
        specs: list[tuple[str, dict[str, Any]]] = []
        f = self.response_format
        if f is not None and f.type == "json_object":
            specs.append(("response_format", {"json_object": True}))
        elif f is not None and f.type == "json_schema":
            if f.json_schema is None:
                raise HttpError(Code.BAD_FIELD, "response_format of type json_schema needs its json_schema",
                                "response_format")
            specs.append(("response_format", {"json_schema": f.json_schema.json_schema}))
        for name, kind in GUIDED.items():
            if getattr(self, name) is not None:
                specs.append((name, {kind: getattr(self, name)}))
        if len(specs) > 1:
            raise HttpError(Code.BAD_FIELD, f"at most one of {', '.join(n for n, _ in specs)} may be set", specs[1][0])
        return specs[0][1] if specs else None

    def submit_params(self, max_new_tokens: int | None, logprobs: bool, top: int, text: bool) -> dict[str, Any]:
        """The submit keywords this request asks for, the prompt aside; `top`: the most probable tokens to report
        with each token; `text`: ask for text (there is a tokenizer)."""
        self.check_supported()
        # temperature 0 is greedy, as in OpenAI; unset: the checkpoint's generation config
        params = {"max_new_tokens": max_new_tokens, "return_text": text or None,
                  "do_sample": None if self.temperature is None else self.temperature > 0,
                  "temperature": self.temperature or None, "top_p": self.top_p, "seed": self.seed,
                  "eos_token_id": -1 if self.ignore_eos else None, "stop": self.stops() or None,
                  "logprobs": logprobs or None, "top_logprobs": top or None, "priority": self.priority or None,
                  "presence_penalty": self.presence_penalty or None, "frequency_penalty": self.frequency_penalty or None,
                  "logit_bias": [[int(t), b] for t, b in self.logit_bias.items()] if self.logit_bias else None,
                  "structured_output": self.structured_output(), "max_weight_lag": self.max_weight_lag,
                  "stale_policy": self.stale_policy, "logprobs_mode": self.logprobs_mode,
                  "speculative": None if self.speculative else False}
        return {k: v for k, v in params.items() if v is not None}


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)  # 0: score the prompt only (one prefill)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the chosen token's, and this many top ones
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise HttpError(Code.EMPTY_PROMPT, "the prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def check_supported(self) -> None:
        super().check_supported()
        if self.stream and (self.scores_prompt() or self.max_tokens == 0):
            raise HttpError(Code.UNSUPPORTED, "echo with logprobs, and max_tokens 0, are answered whole: not with "
                                              "stream", "stream")
        if self.suffix:
            raise HttpError(Code.UNSUPPORTED, "suffix is not supported", "suffix")
        if self.best_of not in (None, self.n):
            raise HttpError(Code.UNSUPPORTED, "best_of other than n is not supported", "best_of")

    def scores_prompt(self) -> bool:
        """`echo` with `logprobs`: the prompt's tokens come back with their logprobs (vLLM's prompt_logprobs)."""
        return self.echo and self.logprobs is not None

    def params(self, text: bool) -> dict[str, Any]:
        """max_tokens 0 (score only) runs the prompt's one prefill, whose one sampled token is not reported."""
        limit = 1 if self.max_tokens == 0 else self.max_tokens
        params = self.submit_params(limit, self.logprobs is not None, self.logprobs or 0, text)
        return params | ({"prompt_logprobs": self.logprobs} if self.scores_prompt() else {})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id ... go to the chat template as given

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it; content parts of type `text` are joined."""
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise HttpError(Code.UNSUPPORTED, "only text content parts are supported", "messages")
            d["content"] = "".join(str(part.get("text", "")) for part in self.content)
        return d


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    functions: list[dict[str, Any]] | None = None  # tools' deprecated form
    audio: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise HttpError(Code.UNSUPPORTED, f"{name} are not supported (no tool calling)", name)
        if self.audio is not None:
            raise HttpError(Code.UNSUPPORTED, "audio output is not supported (text only)", "audio")
        if self.top_logprobs and not self.logprobs:
            raise HttpError(Code.BAD_FIELD, "top_logprobs needs logprobs to be true", "top_logprobs")

    def params(self, text: bool) -> dict[str, Any]:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.submit_params(limit, self.logprobs, self.top_logprobs or 0, text)
