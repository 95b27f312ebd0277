"""Text out of generated tokens, on the driver's front door (docs/protocol.md, "Text and stop strings").

`Detokenizer` decodes one token at a time, as transformers' streamers and vLLM do: a short window of the last
tokens, emitting only what it adds and holding text back while it ends in U+FFFD (an incomplete multi-byte
character). `TextOutput` is one request's text and stop strings (the request desk owns one per ticket)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from cluster.outputs import GenerationOutput, RequestStatus, versions_between

REPLACEMENT = "\ufffd"  # what decode makes of bytes that are not (yet) a whole UTF-8 character


@dataclass
class Detokenizer:
    """Tokens in, text out, one token at a time (`add`), then `flush` at the end."""

    tokenizer: Any
    ids: list[int] = field(default_factory=list)
    text: str = ""  # everything emitted so far
    prefix_offset: int = 0  # the window to decode starts here ...
    read_offset: int = 0  # ... and its text up to here is already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token: int) -> str:
        """Append one token; returns the text it completes ("" while a character is incomplete)."""
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """The end of the tokens: whatever is held back (an incomplete character decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        done = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) <= len(done) or (window.endswith(REPLACEMENT) and not final):
            return ""
        delta = window[len(done):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


@dataclass
class TextOutput:
    """One request's text and stop strings. `update(out)` with each output of the request, in order."""

    detokenizer: Detokenizer
    stops: tuple[str, ...] = ()
    streamed: int = 0  # characters of text already sent to the client
    matched: str | None = None  # the stop string found
    cut: int = 0  # where the text ends when a stop string matched

    @classmethod
    def make(cls, tokenizer: Any, stops: list[str] | None = None, resumed: list[int] | None = None) -> "TextOutput":
        """`resumed`: the tokens a resumed request's client already has (with the text streamed for them)."""
        text = cls(Detokenizer(tokenizer), tuple(stops or ()))
        for token in resumed or ():
            text.detokenizer.add(token)
        text.streamed = text.streamable()
        return text

    @property
    def text(self) -> str:
        return self.detokenizer.text[:self.cut] if self.matched is not None else self.detokenizer.text

    def update(self, out: GenerationOutput) -> bool:
        """Feed `out`'s tokens not seen yet and set `out.text`. True when a stop string matched here: `out` then
        ends, cut after the token that completed the match."""
        seen = len(self.detokenizer.ids)
        for i, token in enumerate(out.generated_tokens[seen:]):
            if self._found(self.detokenizer.add(token)):
                self._end(out, seen + i + 1)
                return True
        if out.is_finished() and self._found(self.detokenizer.flush()):
            self._end(out, len(out.generated_tokens))
            return True
        out.text = self.text
        return False

    def take_delta(self) -> str:
        """The text the client may have now and has not had (all once a stop matched, else `streamable`)."""
        end = len(self.text) if self.matched is not None else self.streamable()
        delta = self.text[self.streamed:end]
        self.streamed = max(self.streamed, end)
        return delta

    def streamable(self) -> int:
        """How much of the text can go out while the request runs: all but its longest tail that may still become a
        stop string."""
        text = self.detokenizer.text
        longest = min(len(text), max((len(s) - 1 for s in self.stops), default=0))
        for k in range(longest, 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return len(text) - k
        return len(text)

    def _found(self, delta: str) -> bool:
        """Look for a stop string `delta` (just appended) could have completed; the earliest match wins."""
        if not delta or not self.stops:
            return False
        text = self.detokenizer.text
        before = len(text) - len(delta)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = text.find(stop, max(0, before - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        self.cut, self.matched = best
        return True

    def _end(self, out: GenerationOutput, n: int) -> None:
        """End `out` at a stop string completed by its token n - 1."""
        out.generated_tokens, out.logprobs = out.generated_tokens[:n], out.logprobs[:n]
        if out.timestamps is not None:
            out.timestamps = out.timestamps[:n]
        if out.top_logprobs is not None:
            out.top_logprobs = out.top_logprobs[:n]
        out.weight_versions = versions_between(out.weight_versions, 0, n)
        out.status, out.finish_reason, out.stop_string = RequestStatus.FINISHED, "stop", self.matched
        out.error = out.error_code = None
        out.text = self.text


def load_tokenizer(model_dir: str | None) -> Any:
    """The checkpoint's tokenizer (transformers' AutoTokenizer), or None when it has none."""
    if not model_dir or not any(os.path.exists(os.path.join(model_dir, f))
                                for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
