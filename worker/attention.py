"""Attention over the paged KV cache for mixed prefill and decode batches.

The token batch is laid out as [decode group | prefill group]. The decode group holds one query token per
sequence (padded to a power of two); the prefill group holds the other sequences' query tokens back to back.
Attention gathers each sequence's keys and values from the cache through precomputed slot indices (built on
the host from the block tables, so the forward itself has static shapes and no host syncs), and masks by
position: key j is visible to a query at position p when j <= p (and p - j < window, for sliding layers).
GQA is handled without repeating keys: the query heads that share a KV head are folded into the query axis.
On CUDA with flash-attn, the decode group instead reads the pages in place (`flash_attn_with_kvcache`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnMeta:
    """Views into the runner's static buffers for one step; their shapes are the step's bucket."""

    positions: torch.Tensor  # [T] position of each token
    slot_mapping: torch.Tensor  # [T] cache slot each token's K/V is written to (padding: the scratch slot)
    dec_kv_slots: torch.Tensor  # [Bd, Ld] slots of each decode sequence's keys, in position order
    dec_q_pos: torch.Tensor  # [Bd] position of each decode query
    pre_q_gather: torch.Tensor  # [Bp * Qp] index of each padded prefill query among the prefill tokens
    pre_out_gather: torch.Tensor  # [Tp] where each prefill token's output sits in the padded result
    pre_kv_slots: torch.Tensor  # [Bp, Lp]
    pre_q_pos: torch.Tensor  # [Bp, Qp]
    logits_idx: torch.Tensor  # [N] tokens whose logits are returned
    dec_block_table: torch.Tensor | None = None  # [Bd, NB] int32, flash-attn decode path only
    dec_kv_lens: torch.Tensor | None = None  # [Bd] int32, flash-attn decode path only
    page_size: int = 0  # tokens a page, for viewing the cache as pages (flash-attn path)

    @property
    def num_decode(self) -> int:
        return self.dec_kv_slots.shape[0]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttnMeta) -> None:
    """Store this step's keys and values; caches are [slots + 1, Hkv, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor,
            q_pos: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """q: [B, Q, Hq, D]; kv_slots: [B, L]; q_pos: [B, Q]. Returns [B, Q, Hq, D]."""
    b, nq, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    length = kv_slots.shape[1]
    k = k_cache[kv_slots].permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    v = v_cache[kv_slots].permute(0, 2, 1, 3)
    key_pos = torch.arange(length, device=q.device)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, L]
    if window is not None:
        mask = mask & (key_pos[None, None, :] > q_pos[:, :, None] - window)
    # fold the g query heads of each KV head into the query axis: [B, Hkv, g * Q, D]
    qf = q.view(b, nq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * nq, d)
    maskf = mask[:, None, None].expand(b, 1, g, nq, length).reshape(b, 1, g * nq, length)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=maskf, scale=scale)
    return out.view(b, hkv, g, nq, d).permute(0, 3, 1, 2, 4).reshape(b, nq, hq, d)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                    window: int | None, scale: float) -> torch.Tensor:
    """q: [T, Hq, D] for the whole token batch, after this step's K/V were written. Returns [T, Hq, D]."""
    bd = meta.num_decode
    outs = []
    if bd and meta.dec_block_table is not None:
        outs.append(_flash_decode(q[:bd], k_cache, v_cache, meta, window, scale))
    elif bd:
        outs.append(_attend(q[:bd].unsqueeze(1), k_cache, v_cache, meta.dec_kv_slots,
                            meta.dec_q_pos[:, None], window, scale).squeeze(1))
    bp, qp = meta.pre_q_pos.shape
    if bp:
        qpre = q[bd:].index_select(0, meta.pre_q_gather).view(bp, qp, q.shape[1], q.shape[2])
        res = _attend(qpre, k_cache, v_cache, meta.pre_kv_slots, meta.pre_q_pos, window, scale)
        outs.append(res.reshape(bp * qp, q.shape[1], q.shape[2]).index_select(0, meta.pre_out_gather))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                  window: int | None, scale: float) -> torch.Tensor:
    """One query per sequence against its pages, read in place by flash-attn. q: [Bd, Hq, D]."""
    from flash_attn import flash_attn_with_kvcache

    paged = (-1, meta.page_size, k_cache.shape[1], k_cache.shape[2])
    out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache.view(paged), v_cache.view(paged),
                                  cache_seqlens=meta.dec_kv_lens, block_table=meta.dec_block_table,
                                  softmax_scale=scale, causal=True,
                                  window_size=(window - 1, 0) if window else (-1, -1))
    return out.squeeze(1)
