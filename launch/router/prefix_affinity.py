"""Which replica holds which prompt prefix in its KV cache, as the router learned it from what it routed.

The router hashes the prompts it routes as a block manager does (driver/engine/block_manager.py `chain_hash`) and
keeps a bounded LRU of hash -> replica, each entry with the replica's epoch then (a restart or new weights empty
its prefix cache: stale entries are ignored). Torch-free."""

from __future__ import annotations

from collections import OrderedDict

from driver.engine.block_manager import chain_hash

DEFAULT_CAPACITY = 65536  # hashes remembered (16 bytes each, plus the dict's overhead)


class PrefixAffinity:
    """A bounded LRU of page hash -> the replica last sent a prompt with that page (and its epoch then)."""

    def __init__(self, page_size: int, capacity: int = DEFAULT_CAPACITY):
        if page_size < 1 or capacity < 1:
            raise ValueError(f"page_size and capacity must be >= 1, got {page_size} and {capacity}")
        self.page_size, self.capacity = page_size, capacity
        self.entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # hash -> (replica, its epoch then)

    def hashes(self, prompt: list[int]) -> list[bytes]:
        """The chained hashes of the prompt's full pages that a block manager could reuse: the last token is
        always computed, so a page ending at the prompt's last token is not counted (as in `match_prefix`)."""
        out, h = [], b""
        for i in range((len(prompt) - 1) // self.page_size):
            h = chain_hash(h, prompt[i * self.page_size:(i + 1) * self.page_size])
            out.append(h)
        return out

    def holders(self, hashes: list[bytes], epochs: dict[int, int]) -> dict[int, int]:
        """Replica -> how many leading pages of the prompt it holds (a hash chains the whole prefix before it, so the
        deepest page counts); entries of an epoch other than the replica's in `epochs` are skipped."""
        depth: dict[int, int] = {}
        for i, h in enumerate(hashes):
            replica, epoch = self.entries.get(h, (None, None))
            if replica is not None and epochs.get(replica) == epoch:
                depth[replica] = i + 1
        return depth

    def learn(self, hashes: list[bytes], replica: int, epoch: int) -> None:
        """The prompt with these page hashes went to `replica` (now in `epoch`)."""
        for h in hashes:
            self.entries[h] = (replica, epoch)
            self.entries.move_to_end(h)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self.entries)
