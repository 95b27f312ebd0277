"""Speculative decoding on rank 0 (docs/speculative.md): a speculating decode row carries its last token and up to k
proposed tokens into one forward; the target's choice at each of those 1 + k positions comes back (the plan's
SCORE_ALL flag: every position's full logits, gathered) and decides how many proposals stand.

Acceptance: position i's choice is exactly the token plain decoding would draw there, given the row's tokens so far
and proposals 0..i-1: the sampler's `pick` at token index + i (greedy: the argmax; sampling: the argmax of the
processed logits plus the request's counter-based Gumbel noise, driver/engine/counter_noise.py). The longest
prefix of proposals equal to the choices is accepted, and the choice after it (the bonus, or the correction at
the first mismatch) is appended too. For a deterministic proposal x that is rejection sampling: x stands with
probability p_target(x), and on rejection the token is drawn from p_target with x removed, renormalised. Being
the same draw as plain decoding's, the output is token for token the non-speculative one, greedy or seeded.

Workers see nothing of this but the plan: a longer query for the row, its logits returned. The rejected positions'
K/V stay in the row's pages past its context; the row's count of computed tokens goes back to its tokens less one,
so the next plan's context length excludes them and its forward overwrites them; pages past the row's tokens
are freed here (BlockManager.trim).

Back-off: a request whose draft had no proposal accepted, or that found no proposal, proposes again only after
1, 2, 4 ... up to MAX_BACKOFF of its decode steps (an accepted proposal resets it). Where proposals do not hit (random
text) the proposer is then mostly off: its host search and the longer, serial verifying step are paid about once
every MAX_BACKOFF steps, and the steps between run as plain decode steps (overlapped and in bursts where the config
asks)."""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from cluster.config import ResolvedConfig
from cluster.dist import Groups, agree_min
from cluster.errors import SpeculativeConfigError
from cluster.speculative import SpeculativeConfig
from driver.engine.block_manager import BlockManager
from driver.engine.draft_model import DraftModel
from driver.engine.ngram import propose
from driver.engine.persistent_batch import PersistentBatch
from driver.engine.request import Request
from driver.engine.sampler import Draw, host_draws, pick, sample_row, to_host
from worker.runner import ModelRunner

MAX_BACKOFF = 16  # the most decode steps a request whose proposals miss waits before it proposes again


@dataclass
class SpecStats:
    """vLLM's spec-decode counters: drafts (rows that carried proposals into a forward), draft tokens, accepted
    tokens, and accepted tokens by their position in the draft."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        """`stats()`'s keys: the counters and the mean accept length (tokens a speculating row gains a forward:
        1 + accepted / drafts, vLLM's "mean acceptance length")."""
        mean = 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0
        return {"spec_drafts": self.drafts, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_tokens": self.accepted_tokens, "spec_accepted_per_pos": list(self.accepted_per_pos),
                "spec_mean_accept_length": mean}


def load_draft(rc: ResolvedConfig, runner: ModelRunner, groups: Groups) -> DraftModel | None:
    """Method "draft"'s model, loaded on the driver (None elsewhere, and without that method). Every rank calls it
    (ranks 0 and 1..n of the control group, one `agree_min`, when the config sets method "draft"): when the driver
    cannot load it, every rank raises SpeculativeConfigError alike, so no worker waits for a loop that never runs."""
    c = rc.speculative
    if c is None or c.method != "draft":
        return None
    draft, error = None, None
    if groups.is_driver:
        try:
            draft = DraftModel(c.model, rc, runner.device, runner.cache.k[0].dtype, runner.model.config.vocab_size)
        except Exception as e:  # noqa: BLE001  (whatever it is, every rank must hear of it)
            error = e
    if not agree_min(int(error is None), groups):
        if isinstance(error, SpeculativeConfigError):
            raise error
        raise SpeculativeConfigError(f"speculative.model={c.model!r}: the driver could not load the draft model"
                                     + (f": {error!r}" if error is not None else ""), "model") from error
    return draft


def speculator_for(rc: ResolvedConfig, draft: DraftModel | None, seed: int | None
                   ) -> tuple["Speculator | None", ResolvedConfig]:
    """The engine's Speculator (None: the config sets none) and the config the engine steps by: with a draft model
    (`load_draft`), which runs the target's plans, in series (no overlap, no bursts)."""
    if rc.speculative is None:
        return None, rc
    if draft is None:
        return Speculator(rc.speculative, seed), rc
    return Speculator(rc.speculative, seed, draft), dataclasses.replace(rc, overlap=False, decode_burst=1)


class Speculator:
    """Proposals for a step's decode rows (`draft`) and their verification (`verify`), rank 0 only."""

    def __init__(self, config: SpeculativeConfig, seed: int | None, draft_model: DraftModel | None = None):
        """`draft_model`: method "draft"'s model on rank 0 (draft_model.py); None: the n-gram proposer."""
        self.config, self.seed, self.model = config, seed, draft_model
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        # a request -> (its misses in a row, decode steps left before it proposes again)
        self.backoff: weakref.WeakKeyDictionary[Request, tuple[int, int]] = weakref.WeakKeyDictionary()
        # a request -> (its tokens so far in a growing int64 buffer, how many are there): each step copies only the
        # tokens generated since, not the whole history
        self.history: weakref.WeakKeyDictionary[Request, tuple[np.ndarray, int]] = weakref.WeakKeyDictionary()

    @staticmethod
    def eligible(req: Request) -> bool:
        """Whether the request speculates: it did not opt out, and its sampling reads no token history (penalties,
        generation options and structured outputs change each position's distribution with the tokens before it:
        those requests decode one token a forward)."""
        return req.speculative and not req.sampling.needs_history

    def wants_host_tokens(self, running: list[Request]) -> bool:
        """Whether a running request could speculate: proposals need every earlier token on the host, so the
        engine collects an overlapped step in flight before it schedules."""
        return any(self.eligible(r) and not self.backoff.get(r, (0, 0))[1] for r in running)

    def _tokens(self, req: Request) -> np.ndarray:
        """The request's tokens (prompt and generated) as int64, from its kept buffer plus the tokens since."""
        n, p = req.num_tokens, len(req.prompt_ids)
        buf, size = self.history.get(req, (None, 0))
        if buf is None or size > n or len(buf) < n:  # first use, a restart (fewer tokens), or full: made anew
            buf = np.empty(max(64, 2 * n), np.int64)
            buf[:p] = req.prompt_ids
            size = p
        buf[size:n] = req.generated[size - p:n - p]
        self.history[req] = (buf, n)
        return buf[:n]

    def _miss(self, req: Request) -> None:
        """No proposal, or none accepted: wait twice as many decode steps as last time (at most MAX_BACKOFF)."""
        streak = self.backoff.get(req, (0, 0))[0]
        self.backoff[req] = (streak + 1, min(1 << streak, MAX_BACKOFF))

    def draft(self, reqs: list[Request], num_tokens: list[int], rows: PersistentBatch, blocks: BlockManager,
              budget: int, keep_free: int) -> dict[Request, np.ndarray]:
        """Give the batch's one-token decode rows whose last token is on the host their proposals: each row's query
        grows by them (`num_tokens`, in place) within the step's token `budget` left, its pages allocated for them
        (a row whose pages are short decodes plainly). Returns each speculating request's proposals."""
        drafts: dict[Request, np.ndarray] = {}
        wanted: list[tuple[int, Request, int]] = []  # the draft model's rows: (batch row, request, tokens to propose)
        c = self.config
        for i, req in enumerate(reqs):
            if num_tokens[i] != 1 or budget <= 0 or not self.eligible(req):
                continue
            streak, wait = self.backoff.get(req, (0, 0))
            if wait:  # backing off: one decode step fewer to wait
                self.backoff[req] = (streak, wait - 1)
                continue
            slot, known = req.slot, req.num_tokens
            if rows.pending[slot] or rows.computed[slot] != known - 1:
                continue
            k = min(c.num_speculative_tokens, int(rows.limit[slot]) - known - 1, budget)  # room for the bonus
            if k < 1:
                continue
            if self.model is not None:  # the draft model writes its K/V ahead: the pages first, its k tokens later
                if blocks.allocate(req, known + k, keep_free=keep_free):
                    wanted.append((i, req, k))
                    budget -= k
                continue
            proposal = propose(self._tokens(req), k, c.prompt_lookup_min, c.prompt_lookup_max)
            if not proposal.size:
                self._miss(req)
                continue
            if not blocks.allocate(req, known + proposal.size, keep_free=keep_free):
                continue
            num_tokens[i] += proposal.size
            budget -= proposal.size
            drafts[req] = proposal
        if wanted:  # the draft model's proposals, every speculating row at once
            reqs_k = [r for _, r, _ in wanted]
            slots = rows.slots(reqs_k)
            for (i, req, _), proposal in zip(wanted, self.model.propose(
                    [r.generated[-1] if r.generated else r.prompt_ids[-1] for r in reqs_k],
                    rows.prompt_len[slots] + np.fromiter(map(len, [r.generated for r in reqs_k]), np.int64,
                                                         len(reqs_k)),
                    np.array([k for _, _, k in wanted], np.int64), rows.table(slots))):
                num_tokens[i] += proposal.size
                drafts[req] = proposal
        return drafts

    def verify(self, logits: torch.Tensor, reqs: list[Request],
               drafts: dict[Request, np.ndarray]) -> list[list[Draw]]:
        """Each speculating request's draws, in order: the target's choice at each position up to and including
        the first that differs from its proposal (or the bonus after the last), ending early at a position whose
        draw failed. `logits` [sum of 1 + proposals, vocab]: every position of each request's row, in row order.
        Counts the drafts."""
        sizes = [1 + len(drafts[r]) for r in reqs]
        rows = [sample_row(r, self.seed) for r in reqs]
        per_pos = [rows[j] for j, n in enumerate(sizes) for _ in range(n)]
        index = [r.token_index + i for r, n in zip(reqs, sizes) for i in range(n)]
        try:
            host, event, top = to_host(pick(logits, per_pos, index=index))
            if event is not None:
                event.synchronize()
            draws = host_draws(host, per_pos, top)
        except Exception as e:  # noqa: BLE001  (it belongs to these requests alone: each fails at its first position)
            draws = [Draw(None, None, e)] * len(per_pos)
        out, first = [], 0
        for req, n in zip(reqs, sizes):
            proposal, mine = drafts[req].tolist(), draws[first:first + n]
            first += n
            taken = 0
            while taken < len(proposal) and mine[taken].error is None and mine[taken].token == proposal[taken]:
                taken += 1
            self._count(len(proposal), taken)
            if taken:
                self.backoff.pop(req, None)
            else:
                self._miss(req)
            out.append(mine[:taken + 1])
        return out

    def _count(self, proposed: int, accepted: int) -> None:
        s = self.stats
        s.drafts += 1
        s.draft_tokens += proposed
        s.accepted_tokens += accepted
        for p in range(accepted):
            s.accepted_per_pos[p] += 1
