"""Which requests run this step, and how many of their tokens: chunked prefill under a token budget.

`fifo` serves running requests first, then admits waiting ones with what is left of the budget; `prefill_first`
admits first. Waiting requests are admitted in the fair queue's order (fair_queue.py: strict priority, then clients
in turn, FCFS within a client); running ones are served by priority, then in admission order. When pages run out
the lowest-priority (highest number), newest other running request is preempted (to the host pool, or recomputed).
Pending tokens of an overlapped step: docs/architecture.md, "Overlapped scheduling", step 1."""

from __future__ import annotations

import bisect
from operator import attrgetter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from cluster.config import ResolvedConfig
from cluster.outputs import RequestStatus
from driver.engine.block_manager import BlockManager
from driver.engine.fair_queue import FairQueue
from driver.engine.fork import Forks
from driver.engine.host_pool import HostPool
from driver.engine.persistent_batch import PersistentBatch
from driver.engine.request import Request


@dataclass
class Scheduled:
    req: Request
    num_tokens: int  # query tokens this step

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so its last logits give the next token."""
        return self.req.num_computed + self.num_tokens == self.req.num_tokens_ahead


@dataclass
class Batch:
    """A step's rows as columns: the requests and their query tokens (iterating gives Scheduled rows)."""

    reqs: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)

    def add(self, req: Request, n: int) -> None:
        self.reqs.append(req)
        self.num_tokens.append(n)

    def __len__(self) -> int:
        return len(self.reqs)

    def __iter__(self) -> Iterator[Scheduled]:
        return map(Scheduled, self.reqs, self.num_tokens)

    def __getitem__(self, i: int) -> Scheduled:
        return Scheduled(self.reqs[i], self.num_tokens[i])


class Scheduler:
    def __init__(self, rc: ResolvedConfig, blocks: BlockManager):
        self.rc, self.blocks = rc, blocks
        self.waiting = FairQueue()
        self.running: list[Request] = []  # by priority, then in admission order (the last: the first to preempt)
        self.keep_free = int(rc.safety_margin * rc.num_blocks)
        self.num_preemptions = 0
        self.host = HostPool(rc.num_host_blocks)
        self.dropped: dict[Request, int] = {}  # preempted without a host copy -> tokens it had computed
        self.batch = PersistentBatch(rc.max_model_len)  # every held request's row
        self.admitting = True  # False while a pause of mode "wait" lets the running requests finish
        self.forks = Forks(blocks)  # n samples of one prompt: parents whose children are not forked yet

    def add(self, req: Request) -> None:
        self.batch.join(req)
        self.waiting.append(req)
        self.forks.add(req)

    def fork_ready(self) -> None:
        """After a plan was sent: fork the children of every parent whose prompt K/V it computes (fork.py); they
        run from the next schedule on, after their parent in the running order."""
        for parent in self.forks.ready():
            forked, alone = self.forks.fork(parent, self.keep_free)
            for child in forked:
                self.batch.join(child)
                bisect.insort_right(self.running, child, key=attrgetter("priority"))
            for child in alone:
                self.add(child)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[Batch, list[Request]]:
        """This step's batch, and the requests that can never fit the cache (to fail)."""
        batch = Batch()
        impossible: list[Request] = []
        budget = [self.rc.max_batch_tokens]
        first = self.rc.scheduler_type == "prefill_first"
        fills = (self._admit, self._continue) if first else (self._continue, self._admit)
        for fill in fills if self.admitting else (self._continue,):
            fill(batch, budget, impossible)
        return batch, impossible

    def burst_length(self, batch: Batch) -> int:
        """How many decode forwards this batch runs from one plan (rc.decode_burst), each row's pages allocated that
        far ahead: more than one only when nobody waits, every running request is in the batch as a one-token
        decode that samples without token history, and every row has that many tokens left before its limits."""
        k = self.rc.decode_burst
        if k <= 1 or self.waiting or len(batch) < len(self.running):
            return 1
        max_len = self.rc.max_model_len
        for s in batch:
            r = s.req
            if s.num_tokens != 1 or not s.samples or r.sampling.needs_history:
                return 1
            ahead = r.num_tokens_ahead
            k = min(k, r.max_new_tokens - (ahead - len(r.prompt_ids)), max_len - ahead)
            if k <= 1:
                return 1
        if not all(self.blocks.allocate(s.req, s.req.num_computed + k) for s in batch):
            return 1  # pages already given to some rows stay theirs: they need them within k tokens anyway
        return k

    def _continue(self, batch: Batch, budget: list[int], impossible: list[Request]) -> None:
        """Serve the running requests in order, as arrays (the persistent batch): each its tokens not yet computed,
        while the budget and the batch's size allow; the few rows that need pages get them in order. When pages
        run out, `_continue_one_by_one` serves them instead (preempting), from the same start."""
        run, cap, b = self.running, self.rc.max_requests_per_batch, self.batch
        room = cap - len(batch)
        if not run or budget[0] <= 0 or room <= 0:
            return
        slots = b.slots(run)
        gen = np.fromiter(map(len, [r.generated for r in run]), np.int64, len(run))
        pending, computed = b.pending[slots], b.computed[slots]
        ahead = b.prompt_len[slots] + gen + pending
        take = (pending == 0) | (ahead < b.limit[slots])  # else its tokens so far reach its limits: it ends when
        if batch:  # the step in flight is collected; and a request admitted this step is in the batch already
            take &= ~np.isin(slots, b.slots(batch.reqs))
        rows = np.flatnonzero(take)[:room]
        need = (ahead - computed)[rows]
        before = budget[0] - (np.cumsum(need) - need)  # the budget left when each row's turn comes
        k = int(np.count_nonzero(before > 0))  # a prefix: `before` only falls
        rows, n = rows[:k], np.minimum(need[:k], before[:k])
        page, allocate = self.blocks.page_size, self.blocks.allocate
        upto = computed[rows] + n
        for j in np.flatnonzero(-(-upto // page) > b.num_pages[slots[rows]]).tolist():
            if not allocate(run[rows[j]], int(upto[j])):
                return self._continue_one_by_one(batch, budget, impossible)
        batch.reqs.extend([run[i] for i in rows.tolist()])
        batch.num_tokens.extend(n.tolist())
        budget[0] -= int(n.sum())

    def _continue_one_by_one(self, batch: Batch, budget: list[int], impossible: list[Request]) -> None:
        """`_continue` when pages run out: the lowest-priority, newest other running request is preempted."""
        scheduled = {id(r) for r in batch.reqs}
        gone: set[int] = set()  # preempted by this loop (a set: `in self.running` would make the loop quadratic)
        cap, max_len, allocate = self.rc.max_requests_per_batch, self.rc.max_model_len, self.blocks.allocate
        for req in list(self.running):
            if budget[0] <= 0 or len(batch) >= cap:
                return
            if id(req) in gone or id(req) in scheduled:
                continue
            ahead = len(req.prompt_ids) + len(req.generated) + req.num_pending
            if req.num_pending and (ahead - len(req.prompt_ids) >= req.max_new_tokens or ahead >= max_len):
                continue  # its tokens so far reach its limits: it ends when the step in flight is collected
            scheduled.add(id(req))
            n = min(ahead - req.num_computed, budget[0])
            while not allocate(req, req.num_computed + n):
                victims = [r for r in self.running if r is not req and id(r) not in scheduled]
                if victims:
                    self.preempt(victims[-1], offload=True)
                    gone.add(id(victims[-1]))
                    continue
                if not batch:  # alone and still too big: it can never run
                    self.running.remove(req)
                    impossible.append(req)
                else:
                    self.preempt(req, offload=True)
                break
            else:
                batch.add(req, n)
                budget[0] -= n

    def _admit(self, batch: Batch, budget: list[int], impossible: list[Request]) -> None:
        while self.waiting and budget[0] > 0 and len(batch) < self.rc.max_requests_per_batch:
            req = self.waiting.peek()
            if req.num_pending:  # preempted while a token was in flight: admit it once the token is here
                return
            swapped = self.host.holds(req)
            cached = self.blocks.attach_cached(req) if swapped else 0
            if not swapped:
                self.blocks.match_prefix(req)
            n = min(req.num_tokens - req.num_computed, budget[0])
            keep = self.keep_free if self.running else 0
            if not self.blocks.allocate(req, req.num_computed + n, keep_free=keep):
                self.blocks.release(req, keep_hashes=swapped)
                if swapped:
                    return
                req.num_computed = 0
                if not self.running and not batch and self.blocks.num_free == self.blocks.num_blocks:
                    self.waiting.pop()
                    impossible.append(req)
                    continue
                return
            if swapped:  # its KV comes back into the first of its new pages, before the forward
                self.host.swap_in(req, req.block_ids[:self.blocks.blocks_for(req.num_computed)], cached)
                self.blocks.register_swapped_in(req)
            elif req in self.dropped:
                self.host.stats.recomputed_tokens += max(0, self.dropped.pop(req) - req.num_computed)
            self.waiting.pop()
            bisect.insort_right(self.running, req, key=attrgetter("priority"))  # at the end of its priority
            if req.status == RequestStatus.PENDING:
                req.status = RequestStatus.PREFILLING
            batch.add(req, n)
            budget[0] -= n

    def preempt(self, req: Request, offload: bool = False) -> None:
        """Free the request's pages and queue it first. `offload`: its computed pages go to the host pool when they
        fit; otherwise it is recomputed from its tokens so far (a waiting request drops its host copy)."""
        pages = req.block_ids[:self.blocks.blocks_for(req.num_computed)]
        # False without a pool (no free slot), and for a forked child whose page copy is not sent yet
        kept = offload and not self.forks.copy_unsent(req) and self.host.swap_out(req, pages)
        self.blocks.release(req, keep_hashes=kept)
        if not kept:
            self.host.drop(req)
            if req.num_computed:
                self.dropped[req] = self.dropped.get(req, 0) + req.num_computed
            req.num_computed = 0
        req.status = RequestStatus.PENDING
        if req in self.running:
            self.running.remove(req)
            self.waiting.push_front(req)
            self.num_preemptions += 1

    def retract(self) -> list[Request]:
        """Free the KV of every request holding some (on the device or in the host pool), newest first: each goes
        back to waiting and recomputes its tokens when admitted again, under the weights in force then (an update's
        kv_policy "recompute", a pause's mode "retract"). Returns them."""
        holding = [r for r in self.running if r.block_ids] + list(self.host.held)
        for req in reversed(holding):
            self.preempt(req)
        return holding

    def offload_stats(self) -> dict[str, int]:
        return asdict(self.host.stats)

    def finish(self, req: Request) -> None:
        """Take a request out of the schedule (finished, failed or cancelled) and free its pages."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.release(req)
        self.host.drop(req)
        self.dropped.pop(req, None)
        self.batch.leave(req)
        for child in self.forks.release(req):  # it ended before its children were forked: they go on alone
            self.add(child)
