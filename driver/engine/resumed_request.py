"""A request resumed after a failure: its prompt carries the tokens delivered before (`resume_tokens`), and its
outputs are the uninterrupted request's.

The client (or whoever journals the request) resubmits prompt, parameters and the tokens it already received
with their weight versions. The server prefills prompt + those tokens and samples on from the next token
index (driver/engine/request.py `token_index`, which the counter-based sampler keys on), so greedy and seeded
sampling continue exactly. Every output of it is stitched back: `generated_tokens` starts with the resumed
tokens, `weight_versions` with theirs, streamed `index`es continue after them, and `resumes` counts the
resumes. docs/recovery.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.outputs import GenerationOutput, join_versions
from driver.engine.request import Request


@dataclass(eq=False)
class ResumedRequest(Request):
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
        out.weight_versions = join_versions(self.resume_versions, [(i + n, v) for i, v in out.weight_versions])
        out.weight_version = out.weight_versions[0][1] if out.weight_versions else out.weight_version
        out.resumes = self.resumes
        return out
