"""Paged KV block bookkeeping: reference counts, prefix sharing by chained block hashes (blake2b: every process and
run agrees), free lists. A block whose last user left stays findable until it is handed out again."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from driver.engine.request import Request


def chain_hash(prev: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(prev + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def token_slice(req: Request, start: int, stop: int) -> list[int]:
    """req.tokens[start:stop] without building the whole token list (its cost follows stop - start)."""
    prompt, n = req.prompt_ids, len(req.prompt_ids)
    if stop <= n:
        return prompt[start:stop]
    if start >= n:
        return req.generated[start - n:stop - n]
    return prompt[start:] + req.generated[:stop - n]


def pages_changed(req: Request) -> None:
    """Tell the request's row of the persistent batch, if it has one, that its block ids changed."""
    if req.batch is not None:
        req.batch.set_pages(req)


class BlockManager:
    def __init__(self, num_blocks: int, page_size: int, allow_sharing: bool):
        self.num_blocks, self.page_size, self.allow_sharing = num_blocks, page_size, allow_sharing
        self.ref = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        # blocks nobody uses, oldest first; unhashed ones are kept at the front so cached prefixes live longest
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.prefix_hit_blocks = 0  # blocks reused from the prefix cache, since start
        self.prefix_query_blocks = 0  # full prompt blocks looked up in the prefix cache, since start

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def match_prefix(self, req: Request) -> None:
        """Attach cached blocks holding a prefix of the request's tokens; at least one token stays to compute. A
        request with prompt logprobs takes none: its every prompt position is computed (prompt_scores.py)."""
        if not self.allow_sharing or req.block_ids or req.prompt_logprobs is not None:
            return
        page, h = self.page_size, b""
        self.prefix_query_blocks += (req.num_tokens - 1) // page
        for i in range((req.num_tokens - 1) // page):
            h = chain_hash(h, token_slice(req, i * page, (i + 1) * page))
            if not self._attach(req, h):
                break
            req.block_hashes.append(h)
            self.prefix_hit_blocks += 1
        req.num_computed = len(req.block_ids) * page
        pages_changed(req)

    def _attach(self, req: Request, h: bytes) -> bool:
        """Give the request a reference to the cached block with hash `h`; False when no block holds it."""
        b = self.hash_to_block.get(h)
        if b is None:
            return False
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1
        req.block_ids.append(b)
        return True

    def share(self, req: Request, block_ids: list[int]) -> None:
        """Give the request references to pages another request holds (a forked child: its parent's full prompt
        pages, driver/engine/fork.py); they are freed when their last holder lets go."""
        for b in block_ids:
            self.ref[b] += 1
        req.block_ids.extend(block_ids)
        pages_changed(req)

    def allocate(self, req: Request, num_tokens: int, keep_free: int = 0) -> bool:
        """Give the request pages for `num_tokens` tokens in all, leaving `keep_free` blocks; False if short."""
        need = self.blocks_for(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.num_free - keep_free:
            return False
        for _ in range(need):
            b, _ = self.free.popitem(last=False)
            old = self.block_hash[b]
            if old is not None and self.hash_to_block.get(old) == b:
                del self.hash_to_block[old]
            self.block_hash[b] = None
            self.ref[b] = 1
            req.block_ids.append(b)
        pages_changed(req)
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the request's pages past those `num_tokens` tokens need (a speculating row's rejected positions:
        pages it alone holds, never hashed, since no full block of them is on the host)."""
        keep = self.blocks_for(num_tokens)
        if len(req.block_ids) <= keep:
            return
        for b in reversed(req.block_ids[keep:]):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)
        del req.block_ids[keep:]
        pages_changed(req)

    def release(self, req: Request, keep_hashes: bool = False) -> None:
        """Drop the request's references. `keep_hashes`: its KV went to the host pool and comes back with them."""
        for b in reversed(req.block_ids):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)
        req.block_ids = []
        pages_changed(req)
        if not keep_hashes:
            req.block_hashes = []

    def register_full_blocks(self, req: Request) -> None:
        """Make the request's newly completed blocks (K/V computed, tokens all on the host) findable."""
        page = self.page_size
        full = min(req.num_computed, req.num_tokens) // page
        if not self.allow_sharing or not req.cacheable or len(req.block_hashes) >= full:
            return  # the common decode step: no block completed, nothing to hash
        for i in range(len(req.block_hashes), full):
            prev = req.block_hashes[-1] if req.block_hashes else b""
            h = chain_hash(prev, token_slice(req, i * page, (i + 1) * page))
            req.block_hashes.append(h)
            b = req.block_ids[i]
            if h not in self.hash_to_block:
                self.hash_to_block[h] = b
                self.block_hash[b] = h

    def attach_cached(self, req: Request) -> int:
        """Before a swap-in: attach the cached blocks that still hold the request's leading full blocks (by its kept
        hashes), so only the rest is copied back. Returns how many."""
        if not self.allow_sharing or not req.cacheable or req.block_ids:
            return 0
        for h in req.block_hashes:
            if not self._attach(req, h):
                break
        pages_changed(req)
        return len(req.block_ids)

    def register_swapped_in(self, req: Request) -> None:
        """After a swap-in: the request's full blocks are findable again in its new pages (where no other is)."""
        if not self.allow_sharing or not req.cacheable:
            return
        for h, b in zip(req.block_hashes, req.block_ids):
            if h not in self.hash_to_block:
                self.hash_to_block[h] = b
                self.block_hash[b] = h

    def forget_cached_prefixes(self) -> None:
        """Forget every hash (after a weight change the cached KV is stale)."""
        self.hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
