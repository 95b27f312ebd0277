"""Rank 0's per-request step state as arrays: the persistent batch (docs/architecture.md, "The persistent batch").

Every request the scheduler holds, waiting or running, has a row (its `slot`) from the moment it is queued until
it ends. The step reads and writes the rows as arrays: how many of its tokens are computed and how many are in
flight (the authoritative copies: `Request.num_computed` and `Request.num_pending` read and write them while the
request has a row), its prompt length and the length at which it ends, its EOS ids, whether it samples plainly,
and its block table. A row changes only when its request joins or leaves, when the step counts its tokens, and
when it gets or gives back pages (BlockManager calls `set_pages`). Only rank 0 holds it; workers get plain plans.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from driver.engine.request import Request

NO_TOKEN = -1  # padding of the EOS table (never a token id)


class PersistentBatch:
    def __init__(self, max_model_len: int, capacity: int = 64) -> None:
        self.max_model_len = max_model_len
        self.reqs: list[Request | None] = []
        self.free: list[int] = []
        self.computed = np.zeros(0, np.int64)  # tokens whose K/V are in the cache or being computed
        self.pending = np.zeros(0, np.int64)  # tokens sampled by a step in flight, not on the host yet
        self.prompt_len = np.zeros(0, np.int64)
        self.limit = np.zeros(0, np.int64)  # prompt + generated length at which the request ends (its limits)
        self.plain = np.zeros(0, bool)  # greedy, nothing read from its history, no logprobs: argmax on the shards
        self.history = np.zeros(0, bool)  # its sampling reads its tokens so far (SamplingParams.needs_history)
        self.extras = np.zeros(0, bool)  # it keeps logprobs or timestamps
        self.scores = np.zeros(0, bool)  # it asks for prompt logprobs (driver/engine/prompt_scores.py)
        self.version = np.zeros(0, np.int64)  # the weight version of its last token (-1: none yet)
        self.eos = np.full((0, 1), NO_TOKEN, np.int64)
        self.pages = np.zeros((0, 1), np.int32)  # block tables; past num_pages a row holds zeros
        self.num_pages = np.zeros(0, np.int64)
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        old = len(self.reqs)
        for name in ("computed", "pending", "prompt_len", "limit", "plain", "history", "extras", "scores", "version",
                     "num_pages"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros(capacity - old, a.dtype)]))
        self.eos = np.concatenate([self.eos, np.full((capacity - old, self.eos.shape[1]), NO_TOKEN, np.int64)])
        self.pages = np.concatenate([self.pages, np.zeros((capacity - old, self.pages.shape[1]), np.int32)])
        self.reqs += [None] * (capacity - old)
        self.free = list(range(capacity - 1, old - 1, -1)) + self.free  # the lowest slot is handed out first

    def join(self, req: Request) -> None:
        """Give the request a row, filled from it; its counts move into the arrays. Idempotent."""
        if req.batch is self:
            return
        if not self.free:
            self._grow(2 * len(self.reqs))
        slot = self.free.pop()
        self.reqs[slot] = req
        computed, pending = req.num_computed, req.num_pending
        p = len(req.prompt_ids)
        self.prompt_len[slot] = p
        self.limit[slot] = min(p + req.max_new_tokens, self.max_model_len)
        self.plain[slot] = req.sampling.greedy and not req.return_logprobs
        self.history[slot] = req.sampling.needs_history
        self.extras[slot] = req.return_logprobs or req.record_timestamps
        self.scores[slot] = req.prompt_logprobs is not None
        self.version[slot] = req.weight_versions[-1][1] if req.weight_versions else -1
        eos = sorted(req.eos_token_ids)
        if len(eos) > self.eos.shape[1]:
            self.eos = np.concatenate([self.eos, np.full((len(self.reqs), len(eos) - self.eos.shape[1]), NO_TOKEN,
                                                         np.int64)], axis=1)
        self.eos[slot] = NO_TOKEN
        self.eos[slot, :len(eos)] = eos
        req.slot, req.batch = slot, self
        self.computed[slot], self.pending[slot] = computed, pending
        self.set_pages(req)

    def leave(self, req: Request) -> None:
        """Free the request's row; its counts go back to the request."""
        if req.batch is not self:
            return
        slot = req.slot
        computed, pending = int(self.computed[slot]), int(self.pending[slot])
        req.slot, req.batch = -1, None
        req.num_computed, req.num_pending = computed, pending
        self.pages[slot, :self.num_pages[slot]] = 0
        self.num_pages[slot] = 0
        self.reqs[slot] = None
        self.free.append(slot)

    def set_pages(self, req: Request) -> None:
        """Copy the request's block ids into its row of the block table (after they changed)."""
        slot, n = req.slot, len(req.block_ids)
        if n > self.pages.shape[1]:
            width = max(n, 2 * self.pages.shape[1])
            self.pages = np.concatenate([self.pages, np.zeros((len(self.reqs), width - self.pages.shape[1]),
                                                              np.int32)], axis=1)
        old = int(self.num_pages[slot])
        if n < old:
            self.pages[slot, n:old] = 0
        if n:
            self.pages[slot, :n] = req.block_ids
        self.num_pages[slot] = n

    def slots(self, reqs: list[Request]) -> np.ndarray:
        """The rows of these requests (each joins first if it has none: a request queued by hand)."""
        slots = np.fromiter([r.slot for r in reqs], np.int64, len(reqs))
        if len(slots) and slots.min() < 0:
            for r in reqs:
                self.join(r)
            slots = np.fromiter([r.slot for r in reqs], np.int64, len(reqs))
        return slots

    def slots_of(self, reqs: list[Request]) -> np.ndarray:
        """The rows of these requests, -1 for one that has none (it ended)."""
        return np.fromiter([r.slot if r.batch is self else -1 for r in reqs], np.int64, len(reqs))

    def table(self, slots: np.ndarray) -> np.ndarray:
        """The block tables of these rows, as wide as the longest ([len(slots), width] int32, zero-padded)."""
        width = int(self.num_pages[slots].max()) if len(slots) else 0
        return self.pages[slots, :width]

    def ends_at(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Whether each row's token is one of its EOS ids."""
        return (self.eos[slots] == tokens[:, None]).any(1)
