"""The `speculative` setting of ContinuousBatchingConfig (docs/speculative.md): which proposer drafts tokens for
decode rows and how many, as a TOML preset's inline table (`speculative = {method = "ngram",
num_speculative_tokens = 4, prompt_lookup_min = 1, prompt_lookup_max = 3}`, or `{method = "draft", model = DIR,
num_speculative_tokens = 4}`), a dict or a SpeculativeConfig. Torch-free."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from cluster.errors import SpeculativeConfigError

METHODS = ("ngram", "draft")  # prompt lookup; a small checkpoint on rank 0 (EAGLE-style heads: docs/speculative.md)
MAX_SPECULATIVE_TOKENS = 16  # proposals a row carries into one verifying forward


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: `method` proposes up to `num_speculative_tokens` tokens after each speculating row's
    last token; one forward of the target verifies them all. n-gram (prompt lookup): the last n tokens of the request
    (prompt and output), n from `prompt_lookup_max` down to `prompt_lookup_min`, matched at their latest earlier
    occurrence; the tokens that followed it are the proposals. draft: `model`, a checkpoint directory of a small model
    with the target's vocabulary, proposes greedily, on rank 0 alone (driver/engine/draft_model.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: str | None = None  # the draft model's checkpoint directory (method "draft" only)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise SpeculativeConfigError(f"speculative.{name}={getattr(self, name)!r}: {why}", name)

        if self.method not in METHODS:
            bad("method", f"must be one of {METHODS} (EAGLE-style heads are not built: docs/speculative.md)")
        if (self.method == "draft") != (self.model is not None):
            bad("model", "a checkpoint directory is needed with method 'draft', and only there")
        if self.model is not None and not os.path.isfile(os.path.join(str(self.model), "config.json")):
            bad("model", "must be a checkpoint directory (no config.json there)")
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            bad("num_speculative_tokens", f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}]")
        if not is_int(self.prompt_lookup_min) or self.prompt_lookup_min < 1:
            bad("prompt_lookup_min", "must be a positive integer")
        if not is_int(self.prompt_lookup_max) or self.prompt_lookup_max < self.prompt_lookup_min:
            bad("prompt_lookup_max", f"must be an integer >= prompt_lookup_min ({self.prompt_lookup_min!r})")

    @classmethod
    def from_any(cls, obj: Any) -> "SpeculativeConfig | None":
        """None (off), a SpeculativeConfig, or a dict of its fields (a preset's inline table)."""
        if obj is None or isinstance(obj, cls):
            return obj
        if not isinstance(obj, dict):
            raise SpeculativeConfigError(f"speculative={obj!r}: expected a table of {[f.name for f in fields()]} "
                                         "or None")
        if unknown := set(obj) - {f.name for f in fields()}:
            raise SpeculativeConfigError(f"speculative: unknown field(s) {sorted(unknown)}; known: "
                                         f"{[f.name for f in fields()]}", sorted(unknown)[0])
        return cls(**obj)


def fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(SpeculativeConfig)
