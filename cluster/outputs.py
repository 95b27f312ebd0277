"""What a request gives back: the seed's GenerationOutput and RequestStatus, plus weight versions."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any


class RequestStatus(IntEnum):
    """Lifecycle of a request. Everything from FINISHED up is terminal."""

    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5


# a request's finish_reason by its terminal status; set where it ends: "length" (max_new_tokens or the context),
# "abort" (a pause of mode "abort", status CANCELLED) and "stale" (beyond its max_weight_lag at an update, FINISHED)
FINISH_REASONS = {RequestStatus.FINISHED: "stop", RequestStatus.FAILED: "error", RequestStatus.CANCELLED: "cancelled"}
OPTIONAL_KEYS = ("resumes", "text", "finish_reason", "stop_string", "top_logprobs", "pauses", "stale_restarts",
                 "prompt_logprobs", "prompt_top_logprobs")  # in to_dict only when set (0 or None: unset)


@dataclass
class GenerationOutput:
    """One request's result (or, when streaming, its state so far). `weight_versions` is compact: (index into
    generated_tokens, version) pairs, one per change; token i comes from the last pair whose index is <= i."""

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None
    status: RequestStatus = RequestStatus.PENDING
    created_time: float = field(default_factory=time.perf_counter)
    lifespan: tuple[float, float] = (-1, -1)
    timestamps: list[float] | None = None
    weight_version: int = 0
    weight_versions: list[tuple[int, int]] = field(default_factory=list)
    error_code: str | None = None  # one of cluster.errors.Code when status is FAILED
    resumes: int = 0  # how many times the request was resumed after a failure (docs/recovery.md)
    text: str | None = None  # the generated text so far, a stop string trimmed off (None: text is off)
    # why it ended: "stop" (EOS or a stop string), "length", "cancelled", "error", "abort", "stale"; None while it runs
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it
    # per generated token, its most probable alternatives as (token, logprob) pairs (None: not asked for)
    top_logprobs: list | None = None
    # each pause that held the request (docs/weights.md, "Pause modes"): (its generated tokens then, the pause's mode)
    pauses: list[tuple[int, str]] | None = None
    stale_restarts: int = 0  # times it restarted from its prompt for its max_weight_lag (docs/weights.md, "Staleness")
    # prompt logprobs (asked with prompt_logprobs): per prompt token, its logprob under the raw model (the first
    # None), and its position's most probable (token, logprob) pairs (the first empty); None: not asked for
    prompt_logprobs: list | None = None
    prompt_top_logprobs: list | None = None

    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    def version_of_token(self, i: int) -> int:
        version = self.weight_version
        for start, v in self.weight_versions:
            if start <= i:
                version = v
        return version

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, for msgpack between ranks and on the wire."""
        d = asdict(self) | {"status": int(self.status), "lifespan": list(self.lifespan),
                            "weight_versions": [list(p) for p in self.weight_versions]}
        for key in OPTIONAL_KEYS:  # additive on the wire: only sent when set, so old outputs look as they did
            if d[key] in (None, 0):
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GenerationOutput":
        d = dict(d) | {"status": RequestStatus(d["status"]), "lifespan": tuple(d["lifespan"]),
                       "weight_versions": [tuple(p) for p in d.get("weight_versions", [])]}
        if d.get("pauses"):
            d["pauses"] = [tuple(p) for p in d["pauses"]]
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in known})  # fields a newer server adds are skipped


def join_versions(first: list[tuple[int, int]], then: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Two compact weight-version lists of one token sequence, `then`'s indices already in the joined
    numbering, as one compact list (a pair that repeats the version before it is dropped)."""
    out = [tuple(p) for p in first]
    for index, version in then:
        if not out or out[-1][1] != version:
            out.append((index, version))
    return out


def versions_between(pairs: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """The compact weight versions of tokens [start, stop) of a sequence whose compact list is `pairs`: the
    version in force at `start`, then each change before `stop`."""
    out: list[tuple[int, int]] = []
    for index, version in pairs:
        if index <= start:
            out = [(start, version)]
        elif index < stop:
            out.append((index, version))
    return out
