"""Which requests run this step, and how many of their tokens: chunked prefill under a token budget.

`fifo` serves running requests first, then admits waiting ones with what is left of the budget; `prefill_first`
admits first. Waiting requests are admitted in the fair queue's order (fair_queue.py: strict priority, then clients
in turn, FCFS within a client); running ones are served by priority, then in admission order. Clients share the
step (fair_share.py): the batch's rows and the token budget are split across clients; a client holding less than
its share of the rows or pages gets them from one holding more, whose newest running request gives way; when pages
run out the lowest-priority (highest number) running request of the client holding most rows, its newest, is
preempted (to the host pool, or recomputed). Pending tokens of an overlapped step: docs/architecture.md,
"Overlapped scheduling", step 1."""

from __future__ import annotations

import bisect
from operator import attrgetter
from collections.abc import Hashable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from cluster.config import ResolvedConfig
from cluster.outputs import RequestStatus
from driver.engine.block_manager import BlockManager
from driver.engine.fair_queue import FairQueue
from driver.engine.fair_share import client_codes, fair_split, gives_way, victim
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
        if self.admitting:
            self._make_room()
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
        """Serve the running requests, as arrays (the persistent batch): each its tokens not yet computed, rows and
        tokens shared across clients (`_share`); the few rows that need pages get them in order. When pages run out,
        `_continue_one_by_one` serves them instead (preempting), from the same start."""
        run, b = self.running, self.batch
        if not run or budget[0] <= 0 or len(batch) >= self.rc.max_requests_per_batch:
            return
        slots = b.slots(run)
        gen = np.fromiter(map(len, [r.generated for r in run]), np.int64, len(run))
        pending, computed = b.pending[slots], b.computed[slots]
        ahead = b.prompt_len[slots] + gen + pending
        take = (pending == 0) | (ahead < b.limit[slots])  # else its tokens so far reach its limits: it ends when
        if batch:  # the step in flight is collected; and a request admitted this step is in the batch already
            take &= ~np.isin(slots, b.slots(batch.reqs))
        rows = np.flatnonzero(take)
        picked, n = self._share([run[i].client for i in rows.tolist()], (ahead - computed)[rows], batch, budget[0])
        rows = rows[picked]
        page, allocate = self.blocks.page_size, self.blocks.allocate
        upto = computed[rows] + n
        for j in np.flatnonzero(-(-upto // page) > b.num_pages[slots[rows]]).tolist():
            if not allocate(run[rows[j]], int(upto[j])):
                return self._continue_one_by_one(batch, budget, impossible)
        batch.reqs.extend([run[i] for i in rows.tolist()])
        batch.num_tokens.extend(n.tolist())
        budget[0] -= int(n.sum())

    def _share(self, clients: list[Hashable], need: np.ndarray, batch: Batch,
               budget: int) -> tuple[np.ndarray, np.ndarray]:
        """Which of the running requests of these clients (in running order, each wanting `need` tokens) get the
        batch's free rows, and how many tokens each: both split across clients (fair_share.fair_split), each client's
        rows in order. Under `fifo` the next waiting request's client takes part in the tokens' split when a row is
        left for it, so its share is kept for `_admit`. Returns the chosen indexes into `clients` and their tokens."""
        room, rows = self.rc.max_requests_per_batch - len(batch), len(clients)
        guest = self._guest() if rows < room else None
        codes = client_codes(clients if guest is None else [*clients, guest.client])
        if rows > room:
            picked = np.flatnonzero(fair_split(codes, np.ones(rows, np.int64), room))
            codes, need = codes[picked], need[picked]
        else:
            picked = np.arange(rows)
        if guest is not None:
            want = min(guest.num_tokens - guest.num_computed, budget)
            need = np.append(need, want if self.blocks.num_free >= self.blocks.blocks_for(want) else 0)
        n = fair_split(codes, need, budget)[:rows]
        return picked[n > 0], n[n > 0]

    def _guest(self) -> Request | None:
        """The waiting request `_admit` takes next after `_continue` (fifo), if any."""
        return self._head() if self.rc.scheduler_type == "fifo" and self.admitting else None

    def _head(self) -> Request | None:
        """The waiting request to admit next, unless none waits or it waits for its token in flight."""
        head = self.waiting.peek() if self.waiting else None
        return None if head is None or head.num_pending else head

    def _continue_one_by_one(self, batch: Batch, budget: list[int], impossible: list[Request]) -> None:
        """`_continue` when pages run out, request by request: the rows and tokens `_share` gives; a row that needs
        a page no one has preempts another running request (fair_share.victim: lowest priority, then the client
        holding most rows, then its newest)."""
        scheduled = {id(r) for r in batch.reqs}
        max_len, allocate = self.rc.max_model_len, self.blocks.allocate
        rows: list[Request] = []
        for req in self.running:
            ahead = len(req.prompt_ids) + len(req.generated) + req.num_pending
            if id(req) in scheduled or (req.num_pending and (ahead - len(req.prompt_ids) >= req.max_new_tokens
                                                             or ahead >= max_len)):
                continue  # its tokens so far reach its limits: it ends when the step in flight is collected
            rows.append(req)
        need = np.fromiter((r.num_tokens_ahead - r.num_computed for r in rows), np.int64, len(rows))
        picked, planned = self._share([r.client for r in rows], need, batch, budget[0])
        gone: set[int] = set()  # preempted by this loop (a set: `in self.running` would make the loop quadratic)
        for req, n in zip([rows[i] for i in picked.tolist()], planned.tolist()):
            if id(req) in gone:
                continue
            scheduled.add(id(req))
            n = min(n, budget[0])
            while not allocate(req, req.num_computed + n):
                victims = [r for r in self.running if r is not req and id(r) not in scheduled]
                if victims:
                    out = victim(self.running, victims)
                    self.preempt(out, offload=True)
                    gone.add(id(out))
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

    def _make_room(self) -> None:
        """Fair admission: when every row, or the pages the next waiting request's first chunk needs, are held and
        its client holds less than its share of them, running requests of a client holding more give way
        (fair_share.gives_way): they are preempted back to the head of their own client's queue."""
        head = self._head()
        if head is None or not self.running:
            return
        cap = self.rc.max_requests_per_batch
        if len(self.running) >= cap and (out := gives_way(self.running, head, cap)) is not None:
            self.preempt(out, offload=True, requeue=True)
        first = head.num_computed + min(head.num_tokens - head.num_computed, self.rc.max_batch_tokens)
        need = self.blocks.blocks_for(first) + self.keep_free
        while self.blocks.num_free < need:
            out = gives_way(self.running, head, self.blocks.num_blocks, lambda r: len(r.block_ids))
            if out is None:
                return
            self.preempt(out, offload=True, requeue=True)

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

    def preempt(self, req: Request, offload: bool = False, requeue: bool = False) -> None:
        """Free the request's pages and queue it first. `offload`: its computed pages go to the host pool when they
        fit; otherwise it is recomputed from its tokens so far (a waiting request drops its host copy). `requeue`:
        it gave way to another client's request, so it goes first in its own client's queue (FairQueue.requeue)."""
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
            (self.waiting.requeue if requeue else self.waiting.push_front)(req)
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
