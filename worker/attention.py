"""Attention over the paged KV cache for mixed prefill and decode batches (docs/architecture.md, "Attention").

The token batch is [decode group | prefill group]: one query token per decoding sequence (padded to a power of
two), then the other sequences' query tokens back to back. Three paths (`ResolvedConfig.attention`): flash-attn's
paged kernels (worker/flash.py) and Lockstep's Triton kernel (worker/triton_attention.py) read the pages in place
through block tables; the paged SDPA path here gathers keys in chunks sized from the shapes alone, so
`attention_workspace_bytes` bounds its workspace whatever the contexts."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from cluster.config import ResolvedConfig
from worker import flash


@dataclass
class AttnMeta:
    """Views into the runner's static buffers for one step; their shapes are the step's bucket."""

    positions: torch.Tensor  # [T] position of each token
    slot_mapping: torch.Tensor  # [T] cache slot each token's K/V is written to (padding: the scratch slot)
    dec_kv_slots: torch.Tensor  # [Bd, Ld] slots of each decode sequence's keys, in position order
    dec_q_pos: torch.Tensor  # [Bd] position of each decode query
    pre_q_gather: torch.Tensor  # [Bp * Qp] index of each padded prefill query among the prefill tokens
    pre_q_scatter: torch.Tensor  # [Bp * Qp] where each padded query's output goes (padding: row Tp, dropped)
    pre_kv_slots: torch.Tensor  # [Bp, Lp]
    pre_q_pos: torch.Tensor  # [Bp, Qp]
    logits_idx: torch.Tensor  # [N] tokens whose logits are returned
    dec_block_table: torch.Tensor | None = None  # [Bd, NB] int32, paged kernels' decode only
    dec_kv_lens: torch.Tensor | None = None  # [Bd] int32, paged kernels' decode only
    # [Bd, burst - 1] SDPA decode bursts: each row's later slots, put in dec_kv_slots as the burst reaches them
    dec_ahead: torch.Tensor | None = None
    pre_flash: flash.VarlenMeta | None = None  # paged kernels' prefill only (flash-attn's varlen layout)
    page_size: int = 0  # tokens a page, for viewing the cache as pages (paged kernels and row-view paths)
    # the scratch block's first slot: padding tokens write into that block, so a token whose slot is below it is
    # real (a MoE layer counts only real tokens' routing)
    scratch_slot: int = 1 << 62
    chunk_elements: int = 1 << 22  # work budget of one SDPA chunk (ResolvedConfig.attn_chunk_elements)
    # `row_views` steps only (dec_kv_slots [Bd, 0]): each real decode row's keys as runs of `unit` cache slots
    # ([rows, units] indices into the cache viewed as [slots / unit, unit, Hkv, D]), and the gathered positions
    # past each row's length inside its last run (`dec_tail`, flat over [rows, units * unit]; row r's from
    # dec_tail_at[r] on), which are zeroed: they may hold a freed request's stale K/V
    dec_units: torch.Tensor | None = None
    dec_tail: torch.Tensor | None = None
    dec_tail_at: list[int] | None = None
    unit: int = 1
    # `row_views` steps only: each real prefill sequence as (first token among the prefill tokens, query count,
    # cached prefix length), so `_prefill_runs` attends each unpadded, the causal square through SDPA's is_causal
    pre_runs: list[tuple[int, int, int]] | None = None
    # the step's path (ResolvedConfig.attention): "flash_attn" and "triton_paged" read dec_block_table, pre_flash
    attention: str = "paged_sdpa"

    @property
    def num_decode(self) -> int:
        return self.dec_kv_slots.shape[0]


@dataclass(frozen=True, eq=False)
class ScoreTerms:
    """What a family adds to a layer's attention scores beyond the scale, the causal mask and the window (one per
    attention module; every path applies them: the eager SDPA path here, worker/triton_attention.py, worker/flash.py).
    `sinks` [Hq] (this rank's query heads; gpt-oss): a learned logit a head that joins every row's softmax
    denominator and carries no value, so the weights of the keys sum to less than one. `softcap` (Gemma 2's
    attn_logit_softcapping): scores become tanh(s / cap) * cap, after the scale and before the mask."""

    sinks: torch.Tensor | None = None
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        return self.sinks is None and self.softcap is None

    def kernel_args(self) -> dict:
        """The paged kernels' keyword arguments (worker/flash.py and worker/triton_attention.py take the same)."""
        return {"sinks": self.sinks, "softcap": self.softcap}


PLAIN = ScoreTerms()


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta) -> None:
    """Store this step's keys and values; caches are [slots + 1, Hkv, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)


def _row_cost(length: int, hkv: int, d: int) -> int:
    """Elements one sequence costs in a chunk whatever its query count: its keys and values, its slots."""
    return 2 * length * hkv * d + 2 * length


def _query_cost(length: int, hq: int, hkv: int, d: int) -> int:
    """Elements one query row costs: scores and softmax of every head (counted twice), masks, q and out."""
    return 2 * hq * length + (1 + hq // hkv) * length + 3 * hq * d


def chunk_shape(b: int, nq: int, length: int, hq: int, hkv: int, d: int, budget: int) -> tuple[int, int]:
    """(sequences, queries) a chunk takes so its elements stay within `budget` (at least one of each)."""
    row, per_q = _row_cost(length, hkv, d), _query_cost(length, hq, hkv, d)
    qc = max(1, min(nq, (budget - row) // per_q))
    rb = max(1, min(b, budget // (row + qc * per_q)))
    return rb, qc


def attention_workspace_bytes(rc: ResolvedConfig, num_heads: int, num_kv_heads: int, head_dim: int,
                              dtype: torch.dtype) -> int:
    """Upper bound of the extra memory one layer's attention allocates in a step (this rank's heads): the attention
    output and its scatter buffer, plus, on the paged SDPA path, one gather chunk at the longest context at 8 bytes
    an element. The paged kernels (flash-attn, Triton) read the pages in place: no gather workspace."""
    outputs = 2 * (rc.max_tokens_padded + 1) * num_heads * head_dim * dtype.itemsize
    if rc.paged_kernels:
        return outputs
    length = rc.max_kv_padded
    one = _row_cost(length, num_kv_heads, head_dim) + _query_cost(length, num_heads, num_kv_heads, head_dim)
    return max(rc.attn_chunk_elements, one) * 8 + outputs


# a step's decode masks, shared by every layer: window size (None: full attention) -> additive mask
# [Bd, 1, 1, Ld] in the model's dtype
StepMasks = dict[int | None, torch.Tensor]


def _visible(length: int, q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[..., L] bool: key j is visible to a query at position p when j <= p (and p - j < window)."""
    key_pos = torch.arange(length, device=q_pos.device)
    mask = key_pos <= q_pos[..., None]
    if window is not None:
        mask = mask & (key_pos > q_pos[..., None] - window)
    return mask


def _bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of a bool mask: 0 where visible, -inf elsewhere (every row sees its own key)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def step_masks(meta: AttnMeta, windows: list[int | None], dtype: torch.dtype) -> StepMasks:
    """The step's decode masks, once for all layers (none on the paged-kernel and row-view paths)."""
    if not meta.num_decode or meta.dec_block_table is not None:
        return {}
    q_pos, length = meta.dec_q_pos, meta.dec_kv_slots.shape[1]
    if meta.dec_units is not None:  # the real rows only, over their runs of slots
        q_pos, length = q_pos[:meta.dec_units.shape[0]], meta.dec_units.shape[1] * meta.unit
    return {w: _bias(_visible(length, q_pos, w), dtype)[:, None, None, :] for w in dict.fromkeys(windows)}


def _gather(cache: torch.Tensor, kv_slots: torch.Tensor) -> torch.Tensor:
    """[B, L] slots -> [B, Hkv, L, D] (a strided view of one index_select over the flattened slots)."""
    b, length = kv_slots.shape
    return cache.index_select(0, kv_slots.reshape(-1)).view(b, length, cache.shape[1], cache.shape[2]).transpose(1, 2)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slots: torch.Tensor,
            bias: torch.Tensor, scale: float, terms: ScoreTerms) -> torch.Tensor:
    """One chunk: q [B, Q, Hq, D], kv_slots [B, L], bias (additive) broadcastable to [B, 1, Q, L] -> [B, Q, Hq, D].
    A cache read as keys and as values (MLA's latent: v_cache is k_cache) is gathered once."""
    keys = _gather(k_cache, kv_slots)
    return _sdpa(q, keys, keys if v_cache is k_cache else _gather(v_cache, kv_slots), bias, scale, terms)


def _explicit(qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
              terms: ScoreTerms, g: int, nq: int) -> torch.Tensor:
    """softmax(cap(q k^T * scale) + bias, with each head's sink in the denominator) v, spelled out as transformers'
    eager attention does (SDPA takes neither): qf [B, Hkv, g * Q, D] (g heads of a KV head, then queries)."""
    s = torch.matmul(qf, k.transpose(-1, -2)).mul_(scale)  # in place: the chunk's budget counts two score copies
    if terms.softcap is not None:  # transformers' order: divide, tanh, multiply, then the mask
        s.div_(terms.softcap).tanh_().mul_(terms.softcap)
    s.add_(bias)
    if terms.sinks is not None:  # one more column a row: its head's sink, dropped after the softmax
        b, hkv = qf.shape[0], qf.shape[1]
        sink = terms.sinks.to(s.dtype).view(1, hkv, g, 1, 1).expand(b, hkv, g, nq, 1).reshape(b, hkv, g * nq, 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(p[..., :k.shape[2]], v)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
          terms: ScoreTerms) -> torch.Tensor:
    """q [B, Q, Hq, D], k and v [B, Hkv, L, D], bias (additive) broadcastable to [B, 1, Q, L] -> [B, Q, Hq, D]."""
    b, nq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    # fold the g query heads of each KV head into the query axis: [B, Hkv, g * Q, D]
    qf = q.view(b, nq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * nq, d)
    if nq > 1:  # [B, 1, Q, L] -> [B, 1, g * Q, L]; one query a row (decode) broadcasts as it is
        bias = bias.unsqueeze(2).expand(b, 1, g, nq, bias.shape[-1]).reshape(b, 1, g * nq, bias.shape[-1])
    if terms.plain:
        out = F.scaled_dot_product_attention(qf, k, v, attn_mask=bias, scale=scale)
    else:
        out = _explicit(qf, k, v, bias, scale, terms, g, nq)
    return out.view(b, hkv, g, nq, d).permute(0, 3, 1, 2, 4).reshape(b, nq, hq, d)


def _decode_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                 bias: torch.Tensor, scale: float, terms: ScoreTerms) -> torch.Tensor:
    """q: [Bd, Hq, D], one query a sequence, in chunks of sequences; bias: [Bd, 1, 1, Ld]. Returns [Bd, Hq, D]."""
    bd, length = meta.dec_kv_slots.shape
    rb, _ = chunk_shape(bd, 1, length, q.shape[1], k_cache.shape[1], q.shape[2], meta.chunk_elements)
    outs = [_attend(q[r:r + rb].unsqueeze(1), k_cache, v_cache, meta.dec_kv_slots[r:r + rb], bias[r:r + rb],
                    scale, terms).squeeze(1) for r in range(0, bd, rb)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


# the eager CPU decode of DECODE_SPLIT_ROWS rows or more gathers at most DECODE_CHUNK_ELEMENTS a chunk (a few MB of
# keys and values, read back by SDPA while still in cache); a smaller batch keeps one chunk, where another SDPA call
# costs more than it saves. A layer's decode on 2 threads, pages of 128, chunks of 1M elements against 4M, two
# interleaved runs (medians of 7): 256 rows of ~255 keys 30.5 / 35.9 ms against 39.9 / 41.7; 128 rows of ~275 keys
# 11.2 / 11.6 against 13.3 / 14.0; 64 rows 3.5 / 3.9 against 3.6 / 4.2; 32 rows 0.78 against 0.67 / 0.72
DECODE_SPLIT_ROWS = 64
DECODE_CHUNK_ELEMENTS = 1 << 20


def _decode_units(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                  bias: torch.Tensor, scale: float, terms: ScoreTerms) -> torch.Tensor:
    """q: [Bd, Hq, D] -> [Bd, Hq, D], the eager CPU decode (docs/architecture.md, "Attention"): the real rows' keys
    gathered `meta.unit` slots at a time (one index_select of whole runs, not one of each slot), in chunks of
    rows; bias: [Bd, 1, 1, L]. Such a step's rows are not padded (step_inputs.py `prepare_step`)."""
    hq, d = q.shape[1], q.shape[2]
    units, unit, at = meta.dec_units, meta.unit, meta.dec_tail_at
    rows, length = units.shape[0], units.shape[1] * unit
    hkv = k_cache.shape[1]
    budget = min(meta.chunk_elements, DECODE_CHUNK_ELEMENTS) if rows >= DECODE_SPLIT_ROWS else meta.chunk_elements
    rb, _ = chunk_shape(rows, 1, length, hq, hkv, d, budget)
    outs = []
    for r in range(0, rows, rb):
        n = min(rb, rows - r)
        tail = meta.dec_tail[at[r]:at[r + n]] - r * length  # this chunk's positions past its rows' lengths
        kv = []
        for cache in (k_cache,) if v_cache is k_cache else (k_cache, v_cache):  # MLA's latent: gathered once
            x = cache.view(-1, unit, hkv, d).index_select(0, units[r:r + n].reshape(-1)).view(n, length, hkv, d)
            x.view(n * length, hkv * d).index_fill_(0, tail, 0.0)
            kv.append(x.transpose(1, 2))
        outs.append(_sdpa(q[r:r + n].unsqueeze(1), kv[0], kv[-1], bias[r:r + n], scale, terms).squeeze(1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _prefill_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                  window: int | None, scale: float, terms: ScoreTerms) -> torch.Tensor:
    """q: [Tp, Hq, D], the prefill group's tokens back to back. In chunks of sequences x queries, gathered from
    q and scattered back, so nothing of the padded [Bp, Qp] size is materialised whole. Returns [Tp, Hq, D]."""
    bp, qp = meta.pre_q_pos.shape
    length = meta.pre_kv_slots.shape[1]
    hq, d = q.shape[1], q.shape[2]
    rb, qc = chunk_shape(bp, qp, length, hq, k_cache.shape[1], d, meta.chunk_elements)
    gather, scatter = meta.pre_q_gather.view(bp, qp), meta.pre_q_scatter.view(bp, qp)
    out = q.new_zeros(q.shape[0] + 1, hq, d)  # the last row takes the padding queries' outputs
    for r in range(0, bp, rb):
        for c in range(0, qp, qc):
            idx = gather[r:r + rb, c:c + qc]
            n, m = idx.shape
            qs = q.index_select(0, idx.reshape(-1)).view(n, m, hq, d)
            bias = _bias(_visible(length, meta.pre_q_pos[r:r + rb, c:c + qc], window), q.dtype).unsqueeze(1)
            res = _attend(qs, k_cache, v_cache, meta.pre_kv_slots[r:r + rb], bias, scale, terms)
            out.index_copy_(0, scatter[r:r + rb, c:c + qc].reshape(-1), res.reshape(n * m, hq, d))
    return out[:-1]


def _prefill_runs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                  window: int | None, scale: float, terms: ScoreTerms) -> torch.Tensor:
    """q: [Tp, Hq, D] -> [Tp, Hq, D], the eager CPU prefill (`meta.pre_runs`): each sequence on its own, unpadded.
    A sequence with nothing cached before its queries, under full attention and plain scores, is a causal square:
    SDPA's `is_causal`, whose CPU kernel skips the key blocks above the diagonal and builds no mask. Others take an
    additive mask over their own keys, queries in chunks sized as `_prefill_sdpa`'s. Padding queries return zeros."""
    hq, d = q.shape[1], q.shape[2]
    out = q.new_zeros(q.shape)
    for i, (start, m, prefix) in enumerate(meta.pre_runs):
        length = prefix + m
        slots = meta.pre_kv_slots[i:i + 1, :length]
        k = _gather(k_cache, slots)  # [1, Hkv, L, D]
        v = k if v_cache is k_cache else _gather(v_cache, slots)
        causal = not prefix and window is None and terms.plain  # the causal square: no mask, one call
        qc = m if causal else chunk_shape(1, m, length, hq, k.shape[1], d, meta.chunk_elements)[1]
        for c in range(0, m, qc):
            n = min(qc, m - c)
            qs = q[start + c:start + c + n]
            bias = None if causal else _bias(_visible(length, torch.arange(prefix + c, prefix + c + n, device=q.device),
                                                      window), q.dtype)[None, None]  # [1, 1, n, L]
            if terms.plain:
                res = F.scaled_dot_product_attention(qs.transpose(0, 1).unsqueeze(0), k, v, attn_mask=bias,
                                                     is_causal=causal, scale=scale, enable_gqa=True)[0].transpose(0, 1)
            else:
                res = _sdpa(qs.unsqueeze(0), k, v, bias, scale, terms)[0]
            out[start + c:start + c + n] = res
    return out


def _paged_kernels(meta: AttnMeta) -> ModuleType:
    """The module whose `decode` and `prefill` read this step's block tables: worker/flash.py, or
    worker/triton_attention.py (imported on first use: Triton is needed on that path only)."""
    if meta.attention == "triton_paged":
        from worker import triton_attention
        return triton_attention
    return flash


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttnMeta,
                    window: int | None, scale: float, masks: StepMasks | None = None,
                    terms: ScoreTerms = PLAIN) -> torch.Tensor:
    """q: [T, Hq, D] for the whole token batch, after this step's K/V were written. Returns [T, Hq, D].
    `masks`: the step's (`step_masks`, computed once for every layer); None: computed here. `terms`: the layer's
    sinks and softcap, if any."""
    bd, outs = meta.num_decode, []
    if bd and meta.dec_block_table is not None:
        outs.append(_paged_kernels(meta).decode(q[:bd], k_cache, v_cache, meta.dec_block_table, meta.dec_kv_lens,
                                                meta.page_size, window, scale, **terms.kernel_args()))
    elif bd:
        masks = masks if masks is not None and window in masks else step_masks(meta, [window], q.dtype)
        decode = _decode_sdpa if meta.dec_units is None else _decode_units
        outs.append(decode(q[:bd], k_cache, v_cache, meta, masks[window], scale, terms))
    if meta.pre_flash is not None:
        outs.append(_paged_kernels(meta).prefill(q[bd:], k_cache, v_cache, meta.pre_flash, meta.page_size, window,
                                                 scale, **terms.kernel_args()))
    elif meta.pre_runs is not None:
        outs.append(_prefill_runs(q[bd:], k_cache, v_cache, meta, window, scale, terms))
    elif meta.pre_q_pos.shape[0]:
        outs.append(_prefill_sdpa(q[bd:], k_cache, v_cache, meta, window, scale, terms))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
