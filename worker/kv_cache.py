"""The paged KV cache tensors of one rank, and its host pool for offloaded pages (worker/kv_offload.py). Slots are
block * page_size + offset; one extra scratch block at the end takes the writes of padding tokens and stands in the
block tables of padding rows, so padded shapes never touch a real page."""

from __future__ import annotations

import numpy as np
import torch

from cluster.errors import LockstepError
from worker.kv_offload import HostKVPool


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token across all layers of this rank's shard."""
    return 2 * num_layers * kv_heads * head_dim * dtype.itemsize


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_host_blocks: int = 0):
        """`num_host_blocks`: pages of the host pool preempted requests' KV is swapped to (0: none)."""
        self.page_size, self.scratch_block, self.scratch_slot = page_size, num_blocks, num_blocks * page_size
        shape = ((num_blocks + 1) * page_size, kv_heads, head_dim)
        self.k, self.v = ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)] for _ in "kv")
        self.host = (HostKVPool(num_layers, num_host_blocks, page_size, kv_heads, head_dim, dtype,
                                pin=device.type == "cuda") if num_host_blocks else None)

    def apply_swaps(self, swap_out: np.ndarray, swap_in: np.ndarray) -> None:
        """Do a plan's page copies (swap-outs, then swap-ins) before its forward. Every rank calls it, same plan."""
        if not (swap_out.size or swap_in.size):
            return
        if self.host is None:
            raise LockstepError("the plan swaps KV pages but this rank has no host pool (cpu_offload_space)")
        self.host.swap(self.k, self.v, self.page_size, swap_out, swap_in)
