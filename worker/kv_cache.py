"""The paged KV cache tensors of one rank, and its host pool for offloaded pages (worker/kv_offload.py). Slots are
block * page_size + offset; one extra scratch block at the end takes the writes of padding tokens and stands in the
block tables of padding rows, so padded shapes never touch a real page."""

from __future__ import annotations

import numpy as np
import torch

from cluster.errors import LockstepError
from worker.kv_offload import HostKVPool


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                       values: bool = True) -> int:
    """K and V of one token across all layers of this rank's shard; `values` False: one tensor a layer, read as
    keys and as values (MLA's latent, worker/latent_attention.py), so half as many bytes a head and dim."""
    return (2 if values else 1) * num_layers * kv_heads * head_dim * dtype.itemsize


class KVCache:
    """`k` and `v`: one tensor a layer each, [slots + 1 page, kv_heads, head_dim]. Without values (`values`
    False: MLA's compressed latent, which attention reads as keys and as values) `v` is `k`, the same tensors:
    every path that takes (k_cache, v_cache) reads the one tensor twice, and `tensors()` lists it once."""

    def __init__(self, num_layers: int, num_blocks: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_host_blocks: int = 0, values: bool = True):
        """`num_host_blocks`: pages of the host pool preempted requests' KV is swapped to (0: none)."""
        self.page_size, self.scratch_block, self.scratch_slot = page_size, num_blocks, num_blocks * page_size
        shape = ((num_blocks + 1) * page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)] if values else self.k
        self.host = (HostKVPool(num_layers, num_host_blocks, page_size, kv_heads, head_dim, dtype,
                                pin=device.type == "cuda", values=values) if num_host_blocks else None)

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct cache tensor (keys, then values where they are cached apart)."""
        return self.k if self.v is self.k else self.k + self.v

    def apply_swaps(self, swap_out: np.ndarray, swap_in: np.ndarray, page_copies: np.ndarray | None = None) -> None:
        """Do a plan's page copies before its forward: swap-outs, then device page copies (`page_copies`: [c, 2]
        (source, destination), a forked child's copy of its parent's last page), then swap-ins. Every rank calls
        it, same plan. The copies sit between the swaps: a page a swap-out reads may be a copy's destination, and a
        copy's source may be a swap-in's destination (both freed and handed out again in the same step)."""
        copies = page_copies is not None and page_copies.size > 0
        if not (swap_out.size or swap_in.size or copies):
            return
        if (swap_out.size or swap_in.size) and self.host is None:
            raise LockstepError("the plan swaps KV pages but this rank has no host pool (cpu_offload_space)")
        if not copies:
            self.host.swap(self.tensors(), self.page_size, swap_out, swap_in)
            return
        none = np.zeros((0, 2), np.int32)
        if swap_out.size:
            self.host.swap(self.tensors(), self.page_size, swap_out, none)
        copy_pages(self.tensors(), self.page_size, page_copies)
        if swap_in.size:
            self.host.swap(self.tensors(), self.page_size, none, swap_in)


def copy_pages(layers: list[torch.Tensor], page_size: int, pairs: np.ndarray) -> None:
    """Copy whole KV pages within each layer's cache (`pairs`: [c, 2] (source page, destination page)), in order,
    on the compute stream: after the forward that wrote the sources, before the next one reads the copies. No
    collective: every rank copies its own shard's pages, as the plan says."""
    dst_pages = pairs[:, 1].tolist()
    if len(set(dst_pages)) < len(dst_pages) or set(dst_pages) & set(pairs[:, 0].tolist()):
        for src_page, dst_page in pairs.tolist():  # a page written twice, or read after a write: one at a time
            copy_pages(layers, page_size, np.asarray([[src_page, dst_page]], np.int32))
        return
    src = torch.as_tensor(pairs[:, 0], dtype=torch.int64, device=layers[0].device)
    dst = torch.as_tensor(pairs[:, 1], dtype=torch.int64, device=layers[0].device)
    for cache in layers:  # one gather and one scatter a layer
        pages = cache.view(-1, page_size, *cache.shape[1:])
        pages.index_copy_(0, dst, pages.index_select(0, src))
