"""The prompts and scenarios the parity tests share with their torchrun scripts."""

from __future__ import annotations

import random

NEW_TOKENS = 32
# 16 prompt lengths from 1 to 300, across page and padding boundaries
PROMPT_LENGTHS = [1, 2, 5, 17, 31, 64, 65, 100, 128, 150, 200, 255, 256, 257, 299, 300]


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def shared_prefix_prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    """4 families of 4 prompts; each family shares a prefix of 100 to 250 tokens."""
    rng = random.Random(seed)
    prompts = []
    for fam in range(4):
        prefix = [rng.randrange(3, vocab) for _ in range(100 + 50 * fam)]
        for k in range(4):
            prompts.append(prefix + [rng.randrange(3, vocab) for _ in range(1 + 13 * k)])
    return prompts


def window_prompts(vocab: int) -> list[list[int]]:
    """The sliding-window families' one in-process batch: two families of two sharing a prefix, and two long
    prompts, 101 to 300 tokens (past their test checkpoints' windows)."""
    shared, mixed = shared_prefix_prompts(vocab), mixed_prompts(vocab)
    return shared[0:2] + shared[8:10] + [mixed[11], mixed[15]]


# fields of a batch of window_prompts that chunks (prompts longer than max_batch_tokens), shares prefixes (two
# families of two) and preempts (a cache of 24 pages)
WINDOW_BATCH = dict(page_size=16, num_blocks=24, max_batch_tokens=128, allow_block_sharing=True)


# Only `default` sizes its cache as a user's run would (CPU: every row at full length, 8,192 pages of 16 for the
# tiny models, 0.1 to 0.2 s a run to zero); `chunked` and `sharing` hold all their requests at once in FULL pages
# (they need under 300). PREEMPT pages hold two to three of the prompts at a time: 8 or 9 preemptions and 200 to 250
# recomputed tokens in every family (32 pages preempted as often, in 1.4x the steps)
FULL, PREEMPT = 512, 48
# name -> (ContinuousBatchingConfig fields, prompt set); shared with tests/scripts/parity_rank.py
SCENARIOS = {
    "default": (dict(page_size=32), "mixed"),
    "chunked": (dict(page_size=16, num_blocks=FULL, max_batch_tokens=64), "mixed"),
    "sharing": (dict(page_size=16, num_blocks=FULL, allow_block_sharing=True, max_batch_tokens=128), "shared"),
    "preempt": (dict(page_size=16, num_blocks=PREEMPT, max_batch_tokens=128), "mixed"),
    # the same small cache with a host pool (50 MiB, far more than the tiny models' preempted pages need)
    "offload": (dict(page_size=16, num_blocks=PREEMPT, max_batch_tokens=128, cpu_offload_space=0.05), "mixed"),
}

# how the parity tests run each scenario: one step a plan in series, overlapped, overlapped with multi-step
# decode (a decode-only batch runs up to 4 forwards a plan), and with n-gram speculative decoding (overlap asked for:
# a speculating row collects the step in flight first; docs/speculative.md)
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SELF = "<the checkpoint itself>"  # mode `draft`: the target's own checkpoint drafts (on rank 0, TP=1): `mode_fields`
MODES = {"serial": dict(use_async_batching=False), "overlap": dict(use_async_batching=True),
         "burst": dict(use_async_batching=True, decode_burst=4),
         "spec": dict(use_async_batching=True, speculative=SPECULATIVE),
         "draft": dict(speculative={"method": "draft", "model": SELF, "num_speculative_tokens": 3})}


# the scenarios each mode runs: overlapped (the default) runs all of them; every other mode the ones where its code
# meets the scheduler's (chunks, shared pages, preemption; multi-step decode's decode-only batches beside shared
# pages and preemption). The host pool (`offload`) swaps the same pages in every mode: overlapped only.
MODE_SCENARIOS = {"overlap": tuple(SCENARIOS), "serial": ("chunked", "sharing", "preempt"),
                  "burst": ("sharing", "preempt"), "spec": ("chunked", "sharing", "preempt"),
                  "draft": ("chunked", "sharing", "preempt")}


def runs_of(modes, scenarios) -> list[tuple[str, str]]:
    """(scenario, mode) pairs to run: each scenario of `scenarios` in each mode of `modes` that runs it."""
    return [(name, mode) for name in scenarios for mode in modes if name in MODE_SCENARIOS[mode]]


def mode_fields(mode: str, model_dir) -> dict:
    """MODES[mode] with the checkpoint's directory for SELF."""
    fields = dict(MODES[mode])
    spec = fields.get("speculative")
    if spec and spec.get("model") == SELF:
        fields["speculative"] = spec | {"model": str(model_dir)}
    return fields


def prompts_for(kind: str, vocab: int) -> list[list[int]]:
    return mixed_prompts(vocab) if kind == "mixed" else shared_prefix_prompts(vocab)
