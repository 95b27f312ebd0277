"""n samples of one prompt from one prefill (transformers' `num_return_sequences`; docs/http.md, "n samples of one
prompt").

A request that asks for n samples carries n - 1 children (`Request.children`, ids `<id>__child#<i>`, as in
transformers' continuous batching). The parent is scheduled like any request; right after the plan that computes
its prompt's K/V up to (at least) the token before the last is sent, its children are forked (`Engine.step`): each
child shares the parent's full prompt pages (their reference counts go up; nobody writes a full prompt page again)
and gets a fresh copy of the partly filled page that holds the rest of those tokens, then computes the last prompt
token itself as a one-token decode and samples its first token from there, as the parent did at the end of its
prefill. The prompt is prefilled once for the group: P + (n - 1) prompt tokens instead of n * P.

Copy rather than recompute the partly filled page: recomputing it would cost each child up to page_size - 1
tokens, which at a 256-token page is most of a short RL prompt. The copy is a plan op (`StepPlan.page_copies`,
source and destination pages), so every rank copies its own shard's page in the same plan, before the forward,
between the plan's swap-outs and swap-ins (worker/kv_cache.py `apply_swaps`): the plan after the one that writes
the source, so after that forward in device order, and before any forward reads the copy (or writes the source
again, should the parent end and its page be handed out meanwhile). Only rank 0 decides; workers hold no request
state.

A child that finds no free page for its copy is queued as an ordinary request and prefilled alone (transformers
does the same). A parent that ends before its fork (cancelled, failed) lets its children go on alone likewise.
A child whose copy has not been sent yet is never swapped out to the host pool (its page is not written yet): it
is preempted by recompute."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.outputs import RequestStatus
from driver.engine.block_manager import BlockManager, pages_changed
from driver.engine.request import Request


NO_COPIES = np.zeros((0, 2), np.int32)
NO_COPIES.flags.writeable = False


@dataclass
class ForkStats:
    forked_children: int = 0  # children that started from their parent's prompt KV
    fork_shared_pages: int = 0  # full prompt pages shared with a parent (a reference, no copy)
    fork_copied_pages: int = 0  # partly filled prompt pages copied for a child (plan page copies)
    fork_fallbacks: int = 0  # children prefilled alone (no free page for the copy, or the parent ended first)


class Forks:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self.parents: list[Request] = []  # held requests whose children are not forked yet, in arrival order
        self.copies: list[tuple[int, int]] = []  # (source page, destination page) the next forward plan carries
        self.unsent: set[int] = set()  # id() of children whose copy is not in a sent plan yet
        self.stats = ForkStats()

    def add(self, req: Request) -> None:
        if req.children and req not in self.parents:
            self.parents.append(req)

    def ready(self) -> list[Request]:
        """Parents to fork now: running, their prompt's K/V computed (or being computed) up to the last token."""
        if not self.parents:
            return []
        return [p for p in self.parents if p.status in (RequestStatus.PREFILLING, RequestStatus.DECODING)
                and p.num_computed >= len(p.prompt_ids) - 1]

    def fork(self, parent: Request, keep_free: int) -> tuple[list[Request], list[Request]]:
        """Fork the parent's live children: (children that share its pages, children to prefill alone). The pages
        they get are theirs; the caller puts the first in the running list and queues the second."""
        self.parents.remove(parent)
        children, parent.children = [c for c in parent.children if not c.is_finished], []
        prefix = len(parent.prompt_ids) - 1  # the tokens whose K/V every sample shares
        page = self.blocks.page_size
        full, partial = prefix // page, prefix % page != 0
        forked, alone = [], []
        for child in children:
            if partial and self.blocks.num_free - keep_free < 1:
                alone.append(child)
                continue
            self.blocks.share(child, parent.block_ids[:full])
            if partial:
                self.blocks.allocate(child, (full + 1) * page)
                self.copies.append((parent.block_ids[full], child.block_ids[full]))
                self.unsent.add(id(child))
                self.stats.fork_copied_pages += 1
            child.block_hashes = parent.block_hashes[:full]
            child.cacheable = parent.cacheable
            child.num_computed = prefix
            child.arrival, child.client = parent.arrival, parent.client
            child.status = RequestStatus.PREFILLING
            pages_changed(child)
            forked.append(child)
            self.stats.forked_children += 1
            self.stats.fork_shared_pages += full
        self.stats.fork_fallbacks += len(alone)
        return forked, alone

    def release(self, parent: Request) -> list[Request]:
        """The parent ends before its fork: its live children, to be queued on their own."""
        if parent not in self.parents:
            return []
        self.parents.remove(parent)
        children, parent.children = [c for c in parent.children if not c.is_finished], []
        self.stats.fork_fallbacks += len(children)
        return children

    def copy_unsent(self, req: Request) -> bool:
        """Whether the request's page copy is still to be sent (then its KV is not on the device yet)."""
        return id(req) in self.unsent

    def take(self) -> np.ndarray:
        """The page copies a plan that runs a forward carries: [c, 2] (source page, destination page), in order."""
        if not self.copies:  # every plan asks: no array made for the steps that fork nothing
            return NO_COPIES
        copies, self.copies = self.copies, []
        self.unsent.clear()
        return np.asarray(copies, np.int32).reshape(-1, 2)
