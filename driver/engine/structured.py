"""Structured outputs (a JSON schema, any JSON object, a regex, a Lark grammar) as a token mask on rank 0's sampler,
through llguidance (docs/architecture.md, "Structured outputs"). Workers and plans never see it.

A request's `structured_output` spec is compiled to an llguidance grammar and checked when the request is built
(RequestRejected naming the problem). Its matcher (`GrammarState`) lives on the request. A constrained request
needs its history (SamplingParams.needs_history): its sample row is built only once every earlier token is on the
host, and it never runs in a burst, so before each of its tokens the matcher consumes the tokens it has not seen
(the resumed ones first, after a restart) and fills the row's bitmask in Rust (one bit a token, no Python loop over
the vocabulary); the sampler expands the bits and masks the logits with tensor ops on their device. llguidance is
imported when a spec is first seen; without it a structured request is refused (`unsupported`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from cluster.errors import Code, RequestRejected

KINDS = ("json_schema", "json_object", "regex", "grammar")
MAX_SPEC_CHARS = 1 << 16  # a spec's JSON text (a schema, a regex, a grammar)
# JSON as json.dumps writes it: no free whitespace (a schema's own "x-guidance" options may say otherwise), so a
# model cannot spend its tokens on blanks between the values
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
INSTALL = "structured outputs need llguidance: pip install 'lockstep-serve[structured]' (or llguidance)"


class BadSpec(ValueError):
    """Why a structured_output spec is refused."""


def llguidance() -> Any:
    """The llguidance module, or RequestRejected (unsupported) saying how to install it."""
    try:
        import llguidance as llg
        import llguidance.hf  # noqa: F401  (not llguidance.torch: its import compiles a kernel we do not use, 1.4 s)
    except ImportError:
        raise RequestRejected(INSTALL, Code.UNSUPPORTED) from None
    return llg


def grammar_of(spec: Any) -> str:
    """The llguidance grammar of a spec: {"json_schema": schema (a map or its JSON text)}, {"json_object": true},
    {"regex": str} or {"grammar": Lark text}; BadSpec naming what is wrong (the compiler's own words)."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise BadSpec(f"a map with exactly one of {', '.join(KINDS)}")
    (kind, value), = spec.items()
    if len(json.dumps(value)) > MAX_SPEC_CHARS:
        raise BadSpec(f"its {kind} is longer than {MAX_SPEC_CHARS} characters")
    matcher = llguidance().LLMatcher
    try:
        if kind == "json_schema":
            if not isinstance(value, (dict, str)):
                raise BadSpec("json_schema must be a JSON schema (a map)")
            grammar = matcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
        elif kind == "json_object":
            if value is not True:
                raise BadSpec("json_object must be true")
            grammar = matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        elif not isinstance(value, str) or not value:
            raise BadSpec(f"{kind} must be a non-empty string")
        else:
            grammar = (matcher.grammar_from_regex if kind == "regex" else matcher.grammar_from_lark)(value)
    except ValueError as e:
        raise BadSpec(f"invalid {kind}: {e}") from None
    error = matcher.validate_grammar(grammar)
    if error:
        raise BadSpec(f"invalid {kind}: {error.strip()}")
    return grammar


@lru_cache(maxsize=4)
def tokenizer_of(model_dir: str, vocab_size: int, eos: tuple[int, ...]) -> Any:
    """llguidance's view of the checkpoint's tokenizer (its ids up to the model's vocabulary; EOS ends a grammar)."""
    llg = llguidance()
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001  (no tokenizer files, or unreadable ones)
        raise RequestRejected(f"structured outputs need the checkpoint's tokenizer: {e}", Code.NO_TOKENIZER) from None
    return llg.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=list(eos) or None)


@dataclass(eq=False)
class GrammarState:
    """One request's matcher and how many of its tokens it has consumed."""

    matcher: Any
    words: int  # int32 words of its bitmask: ceil(vocab / 32)
    eos: frozenset[int] = frozenset()  # what the grammar allows once complete: they end the request
    consumed: int = 0
    bitmask: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.bitmask = torch.zeros(self.words, dtype=torch.int32)

    def allowed(self, generated: list[int]) -> torch.Tensor:
        """The bitmask [words] int32 of the tokens the grammar allows after `generated` (every token the request
        generated, those before a restart first), consuming the ones not seen yet. A fresh tensor each call (a
        sample row keeps it). All zero once the matcher is in error: no token survives, the row fails."""
        fresh = generated[self.consumed:]
        if fresh:
            self.matcher.consume_tokens(fresh)
            self.consumed = len(generated)
        if self.matcher.is_error():
            return torch.zeros(self.words, dtype=torch.int32)
        # llguidance.torch.fill_next_token_bitmask's own call: the matcher writes the words in place, GIL released
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.words * 4)
        return self.bitmask.clone()


def grammar_state(grammar: str, model_dir: str, vocab_size: int, eos: frozenset[int]) -> GrammarState:
    """A new request's matcher (RequestRejected naming the problem when llguidance refuses the grammar). `eos`: the
    request's EOS ids (none: the tokenizer's), which the grammar allows once complete."""
    llg = llguidance()
    tokenizer = tokenizer_of(model_dir, vocab_size, tuple(sorted(eos)))
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise RequestRejected(f"structured_output is refused: {matcher.get_error()}", Code.BAD_FIELD)
    return GrammarState(matcher, (vocab_size + 31) // 32, frozenset(tokenizer.eos_tokens))


def mask_rows(x: torch.Tensor, bitmasks: list[torch.Tensor]) -> torch.Tensor:
    """x with each row's disallowed tokens at -inf; `bitmasks`: one [words] int32 bitmask a row (bit t of word
    t // 32 set: token t allowed), expanded on x's device."""
    words = torch.stack(bitmasks).to(x.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(bitmasks), -1).bool()
    vocab = x.shape[-1]
    if allowed.shape[-1] < vocab:  # logits wider than the tokenizer's ids: the rest is never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]))
    return x.masked_fill(~allowed[:, :vocab], float("-inf"))
