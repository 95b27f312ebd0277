"""A request as the driver tracks it. Only the driver holds these; workers never see request state."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from cluster.outputs import GenerationOutput, RequestStatus, join_versions

LOCAL_CLIENT = "local"  # the client of requests that carry none (the manager API): they share one turn


@dataclass
class SamplingParams:
    """A request's sampling parameters and generation options (GenerationConfig's names; option_checks.py)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_new_tokens: int | None = None  # None: unset (set, it overrides min_length, as in transformers)
    min_length: int = 0  # prompt included; 0: off
    no_repeat_ngram_size: int = 0  # 0: off
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] = ()  # (sequence, bias), one entry per sequence
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple[int, ...] = ()
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    # OpenAI's: (token, bias) added to its logit; -(count * frequency + (count > 0) * presence) for every token the
    # request generated (its prompt aside), before temperature (logits_processing.py)
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    structured_output: str | None = None  # an llguidance grammar (driver/engine/structured.py): a token mask

    @property
    def constrained(self) -> bool:
        """True when some generation option is set (driver/engine/constraint_processors.py applies them)."""
        return bool(self.min_new_tokens or self.min_length or self.no_repeat_ngram_size or self.bad_words_ids
                    or self.sequence_bias or self.forced_bos_token_id is not None or self.forced_eos_token_id
                    or self.suppress_tokens or self.begin_suppress_tokens)

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's tokens so far (repetition penalty, generation options): then a
        step's rows wait until every earlier token is on the host, and the request never runs in a burst."""
        return (self.repetition_penalty != 1.0 or self.constrained or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or self.structured_output is not None)

    @property
    def greedy(self) -> bool:
        return not self.do_sample and not self.needs_history and not self.logit_bias


class RowCount:
    """A count the step keeps in the request's row of the persistent batch (array `column`) while it has one, and
    in the request itself (`_<name>`) otherwise; reads and writes go to whichever holds it."""

    def __init__(self, column: str) -> None:
        self.column = column

    def __set_name__(self, owner: type, name: str) -> None:
        self.own = "_" + name

    def __get__(self, req: "Request | None", owner: type) -> "int | RowCount":
        if req is None:
            return self
        b = req.batch
        return getattr(req, self.own) if b is None else int(getattr(b, self.column)[req.slot])

    def __set__(self, req: "Request", value: int) -> None:
        if req.batch is None:
            setattr(req, self.own, value)
        else:
            getattr(req.batch, self.column)[req.slot] = value


@dataclass(eq=False)  # identity, not field equality: requests are tracked by reference
class Request:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    streaming: bool = False
    record_timestamps: bool = False
    return_logprobs: bool = False
    num_top_logprobs: int = 0  # > 0: each token's most probable alternatives too (implies return_logprobs)
    # prompt logprobs (driver/engine/prompt_scores.py): None: not asked; k >= 0: each prompt token's logprob and its
    # position's k most probable tokens; prompt_scores holds them per prompt position (the first stays None)
    prompt_logprobs: int | None = None
    logprobs_mode: str = "processed_logprobs"  # what its logprobs report (driver/engine/logprobs_mode.py)
    prompt_scores: list | None = field(default=None, repr=False)
    # fair scheduling (driver/engine/fair_queue.py): lower priority numbers go first; clients take turns
    priority: int = 0
    client: Hashable = LOCAL_CLIENT  # who sent it: the front door's ZeroMQ identity, else LOCAL_CLIENT
    arrival: int = -1  # the scheduler's arrival number (FCFS within a client), set when it is queued
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # per token, num_top_logprobs
    timestamps: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.PENDING
    error: str | None = None
    error_code: str | None = None  # cluster.errors.Code, set with `error`
    finish_reason: str | None = None  # set with a terminal status (cluster/outputs.py FINISH_REASONS, or "length")
    # num_computed and num_pending (RowCount below) while the request has no row in the persistent batch
    _num_computed: int = field(default=0, repr=False)
    _num_pending: int = field(default=0, repr=False)
    slot: int = -1  # its row in the persistent batch (driver/engine/persistent_batch.py), -1: none
    batch: object = field(default=None, repr=False)  # that PersistentBatch while it has a row
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the leading full blocks
    cacheable: bool = True  # False once its KV mixes weight versions: its blocks are never shared
    created_time: float = field(default_factory=time.perf_counter)
    start_time: float = -1.0
    end_time: float = -1.0
    weight_versions: list[tuple[int, int]] = field(default_factory=list)
    sample_key: int | None = None  # the 64-bit noise key of counter-based sampling, made by the sampler on first use
    sample_cache: object = field(default=None, repr=False)  # its SampleRow when sampling reads no history (sampler.py)
    # driver.engine.constraint_processors.History: what the generation options keep between steps, made on first use
    history: object = None
    grammar: object = None  # driver.engine.structured.GrammarState when sampling.structured_output is set
    # how many of prompt_ids' last tokens were generated before a restart (a client's resume_tokens): they count in
    # the token index, so the resumed request samples what the uninterrupted one would have
    resumed_tokens: int = 0
    sink: object = None  # callable(GenerationOutput) on the loop thread (the front door's), else the ResultRouter
    # n samples of one prompt (driver/engine/fork.py): the children this request forks once its prompt but the last
    # token is computed (emptied then), and a child's index among its parent's (-1: not a child)
    children: list["Request"] = field(default_factory=list, repr=False)
    child_index: int = -1
    # one copy of prompt_ids that every output of this request shares, so a streamed token costs no prompt copy
    prompt_out: list[int] | None = field(default=None, repr=False)
    # staleness (driver/engine/staleness.py): the versions its tokens may span (None: unbounded), what an update
    # beyond them does ("end" or "restart"), and its restarts so far; and each pause that held it (pause_modes.py)
    max_weight_lag: int | None = None
    stale_policy: str = "end"
    stale_restarts: int = 0
    pauses: list[tuple[int, str]] = field(default_factory=list)
    speculative: bool = True  # False: it never speculates, even when the engine does (docs/speculative.md)

    # tokens whose K/V are in the cache (or are being computed by the step in flight)
    num_computed = RowCount("computed")
    # overlapped scheduling: tokens sampled by a step in flight, not on the host yet (the next step reads them on
    # the device); they count in num_computed once a step has run them, never in `generated`
    num_pending = RowCount("pending")

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def num_tokens_ahead(self) -> int:
        """Tokens known on the host plus those sampled but still in flight: where the next token goes."""
        return len(self.prompt_ids) + len(self.generated) + self.num_pending

    @property
    def token_index(self) -> int:
        """The index of the next token to sample: the tokens generated so far, before and after any restart."""
        return self.resumed_tokens + len(self.generated)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    def note_version(self, version: int) -> None:
        """Record the weight version of the token about to be appended."""
        if not self.weight_versions or self.weight_versions[-1][1] != version:
            self.weight_versions.append((len(self.generated), version))

    def output(self) -> GenerationOutput:
        """A snapshot of the request; its outputs share one copy of the prompt, so its cost follows the tokens."""
        if self.prompt_out is None:
            self.prompt_out = list(self.prompt_ids)
        return GenerationOutput(
            request_id=self.request_id, prompt_ids=self.prompt_out, generated_tokens=list(self.generated),
            logprobs=list(self.logprobs), error=self.error, status=self.status, created_time=self.created_time,
            lifespan=(self.start_time, self.end_time),
            timestamps=list(self.timestamps) if self.record_timestamps else None,
            weight_version=self.weight_versions[0][1] if self.weight_versions else 0,
            weight_versions=list(self.weight_versions), error_code=self.error_code, finish_reason=self.finish_reason,
            top_logprobs=list(self.top_logprobs) if self.num_top_logprobs else None,
            pauses=[(i + self.resumed_tokens, mode) for i, mode in self.pauses] or None,
            stale_restarts=self.stale_restarts, **self.prompt_score_lists())

    def prompt_score_lists(self) -> dict[str, list | None]:
        """GenerationOutput's prompt_logprobs and prompt_top_logprobs (per prompt position; the first None and ())."""
        if self.prompt_logprobs is None:
            return {}
        scores = self.prompt_scores or [None] * len(self.prompt_ids)
        return {"prompt_logprobs": [None if s is None else s.logprob for s in scores],
                "prompt_top_logprobs": [() if s is None else s.top for s in scores]}


@dataclass(eq=False)
class ResumedRequest(Request):
    """A request resumed after a failure (docs/recovery.md): its prompt carries the tokens delivered before and it
    samples on from the next token index, so greedy and seeded sampling continue exactly; its outputs are the
    uninterrupted request's."""

    # versions of the resumed tokens (compact: (index into them, version) per change), as the client got them
    resume_versions: list[tuple[int, int]] = field(default_factory=list)
    resumes: int = 0  # how many times this request was resumed, this one included

    def output(self) -> GenerationOutput:
        out = super().output()
        n = self.resumed_tokens
        if n:
            resumed = out.prompt_ids[-n:]
            out.prompt_ids = out.prompt_ids[:-n]
            out.generated_tokens = resumed + out.generated_tokens
            if out.logprobs:  # the resumed tokens' logprobs were not sent back: NaN keeps the lists aligned
                out.logprobs = [float("nan")] * n + out.logprobs
            if out.timestamps is not None:
                out.timestamps = [float("nan")] * n + out.timestamps
            if out.top_logprobs is not None:
                out.top_logprobs = [()] * n + out.top_logprobs
        out.weight_versions = join_versions(self.resume_versions, [(i + n, v) for i, v in out.weight_versions])
        out.weight_version = out.weight_versions[0][1] if out.weight_versions else out.weight_version
        out.resumes = self.resumes
        return out
