"""The paged KV cache tensors of one rank.

Slots are numbered block * page_size + offset. One extra scratch block at the end takes the writes of
padding tokens (at its first slot) and stands in the block tables of padding rows, so padded shapes never
touch a real page. worker/flash.py views a layer as [blocks, page, heads, dim] for flash-attn's kernels.
"""

from __future__ import annotations

import torch


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token across all layers of this rank's shard."""
    return 2 * num_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.page_size = page_size
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        self.scratch_slot = num_blocks * page_size
        shape = ((num_blocks + 1) * page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
