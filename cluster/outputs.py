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


@dataclass
class GenerationOutput:
    """One request's result (or, when streaming, its state so far).

    `weight_versions` is compact: a list of (index into generated_tokens, version) pairs, one per change, so
    token i was produced by the last pair whose index is <= i.
    """

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

    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    def version_of_token(self, i: int) -> int:
        """The weight version that produced generated token i."""
        version = self.weight_version
        for start, v in self.weight_versions:
            if start <= i:
                version = v
        return version

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, for msgpack between ranks and on the wire."""
        d = asdict(self)
        d["status"] = int(self.status)
        d["lifespan"] = list(self.lifespan)
        d["weight_versions"] = [list(p) for p in self.weight_versions]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GenerationOutput":
        d = dict(d)
        d["status"] = RequestStatus(d["status"])
        d["lifespan"] = tuple(d["lifespan"])
        d["weight_versions"] = [tuple(p) for p in d.get("weight_versions", [])]
        return cls(**d)
