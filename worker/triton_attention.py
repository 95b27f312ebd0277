"""Paged attention in Triton, for CUDA where flash-attn is absent (docs/architecture.md, "Attention"): the keys
and values are read in place from their pages through the block table, at each sequence's own length, for the
decode group and for the prefill group alike. The layout is flash-attn's (worker/flash.py): caches
[slots + 1, Hkv, D], int32 block tables max_blocks_per_request wide whose padding points at the scratch block,
kv lens for the decode group, cu_seqlens for the prefill group; `decode` and `prefill` take the same arguments as
`flash.decode` and `flash.prefill`.

One program per (sequence, KV head, block of rows); a row is a (query, query head) pair of that KV head's GQA
group, so the g query heads sharing a KV head read its keys once. Keys come BLOCK_N at a time (slot of key j:
block_table[seq, j // page] * page + j % page, so BLOCK_N need not be the page size), with an online softmax in
float32; query i of a sequence of q_len queries and kv_len keys sits at position kv_len - q_len + i and sees key j
when j <= position (and position - j < window). A layer's score terms (worker/attention.py `ScoreTerms`) are
constexpr switches: SOFTCAP caps each score (tanh(s / cap) * cap, after the scale, before the mask); HAS_SINKS starts
each row's online softmax at its head's sink (running max = the sink, denominator = 1, nothing accumulated), which
is the sink's column of transformers' softmax, so a row that sees no key writes zeros. float32 inputs multiply in
IEEE float32 (no TF32), so float32 serving stays token-identical to transformers. No host sync: the decode grid
comes from the bucket's shapes only, so a decode step can be captured in a CUDA graph.

With TRITON_INTERPRET=1 set before triton is first imported (its own `tl.zeros`, `tl.max` ... are decorated then,
and this kernel when this module is imported), the kernel runs on CPU tensors through Triton's interpreter:
tests/test_triton_attention.py checks it so, in a child process, against a float64 reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.flash import VarlenMeta

LOG2E = 1.4426950408889634


@triton.jit
def dot_float32(a, b, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """a @ b in float32. WIDEN (the interpreter with bfloat16 only: triton 3.8's interpreter multiplies bfloat16
    tiles as their raw bits) multiplies the same values widened to float32, as a bfloat16 MMA accumulates them."""
    if WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION, out_dtype=tl.float32)


@triton.jit
def _tanh(x):
    """tanh from one exp (Triton's language has none), exact to float32 rounding: sign(x) (1 - e) / (1 + e),
    e = exp(-2 |x|)."""
    e = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -y, y)


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, lens_ptr, cu_q_ptr, cu_k_ptr, sinks_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh, stride_tb,
        scale_log2, scale, softcap,
        G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, WINDOW: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
        WIDEN: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr):
    """o[rows] = softmax(q k^T * scale) v for one (sequence, KV head, row block). VARLEN: the prefill group
    (cu_q_ptr, cu_k_ptr give each sequence's queries and keys); else one query a sequence at lens_ptr's length."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # (query, head) pairs of this KV head's group
    qi, head = row // G, kvh * G + row % G
    if VARLEN:
        q_start = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_start
        kv_len = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
    else:
        q_start = seq
        q_len = 1
        kv_len = tl.load(lens_ptr + seq)
    live = qi < q_len
    pos = kv_len - q_len + qi  # each row's query position
    dim = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh + dim[None, :],
                mask=live[:, None] & (dim[None, :] < D), other=0.0)

    # keys the block's rows can see: up to its last live row's position, from its first row's window
    first = kv_len - q_len + (tl.program_id(2) * BLOCK_M) // G
    last = kv_len - q_len + tl.minimum((tl.program_id(2) * BLOCK_M + BLOCK_M - 1) // G, q_len - 1)
    hi = tl.minimum(kv_len, last + 1)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(first - WINDOW + 1, 0)

    if HAS_SINKS:  # the sink's column first: exp2(sink - max) = 1 with the max at the sink
        m_i = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = table_ptr + seq * stride_tb
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        inside = j < hi  # never read a key past the sequence's length (it may not be written yet)
        block = tl.load(table + j // PAGE, mask=inside, other=0)
        slot = block.to(tl.int64) * PAGE + j % PAGE
        load_mask = inside[:, None] & (dim[None, :] < D)
        k = tl.load(k_ptr + slot[:, None] * stride_kt + kvh * stride_kh + dim[None, :], mask=load_mask, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kvh * stride_vh + dim[None, :], mask=load_mask, other=0.0)
        if SOFTCAP:  # transformers' order: scale, divide, tanh, multiply (then to base 2 for exp2)
            s = dot_float32(q, tl.trans(k), PRECISION, WIDEN) * scale
            s = _tanh(s / softcap) * softcap * 1.4426950408889634
        else:
            s = dot_float32(q, tl.trans(k), PRECISION, WIDEN) * scale_log2
        visible = inside[None, :] & (j[None, :] <= pos[:, None])
        if WINDOW > 0:
            visible = visible & (pos[:, None] - j[None, :] < WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot_float32(p.to(v.dtype), v, PRECISION, WIDEN)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows that saw no key (padding) write zeros
    tl.store(o_ptr + (q_start + qi)[:, None] * stride_ot + head[:, None] * stride_oh + dim[None, :],
             out.to(o_ptr.dtype.element_ty), mask=live[:, None] & (dim[None, :] < D))


# TRITON_INTERPRET=1 when this module was imported: the kernel runs through Triton's interpreter (CPU tensors)
INTERPRETED = type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def tiles(rows: int, d_pad: int, itemsize: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for `rows` (query, head) pairs a sequence and KV head: at least 16 each (tl.dot's
    smallest tile), powers of two, a key tile of at most 16 KB and a row tile of at most 32 KB."""
    width = d_pad * itemsize
    block_n = 64 if width <= 256 else 32 if width <= 512 else 16
    block_m = min(64 if width <= 512 else 32, max(16, _next_pow2(rows)))
    return block_m, block_n


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
            lens: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, num_seqs: int, max_q: int, page_size: int,
            window: int | None, scale: float, varlen: bool, sinks: torch.Tensor | None,
            softcap: float | None) -> None:
    """Launch the kernel over (num_seqs, KV heads, row blocks of max_q queries x g heads). `sinks`: [Hq], any
    float dtype (read as float32); `softcap`: None or the cap."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    g = hq // hkv
    d_pad = max(16, _next_pow2(d))
    block_m, block_n = tiles(max_q * g, d_pad, q.element_size())
    grid = (num_seqs, hkv, triton.cdiv(max_q * g, block_m))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, table, lens, cu_q, cu_k, lens if sinks is None else sinks.contiguous(),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), table.stride(0), scale * LOG2E, scale, softcap or 1.0,
        G=g, D=d, D_PAD=d_pad, PAGE=page_size, WINDOW=window or 0, BLOCK_M=block_m, BLOCK_N=block_n,
        VARLEN=varlen, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WIDEN=INTERPRETED and q.dtype == torch.bfloat16, SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        num_warps=4, num_stages=2)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
           kv_lens: torch.Tensor, page_size: int, window: int | None, scale: float,
           sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """One query per sequence against its pages, read in place. q: [Bd, Hq, D]; block_table [Bd, NB] int32;
    kv_lens [Bd] int32 (a padding row: 0, or 1 with the scratch block). Returns [Bd, Hq, D]; capturable."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0]:
        _launch(q, k_cache, v_cache, out, block_table, kv_lens, kv_lens, kv_lens, q.shape[0], 1, page_size,
                window, scale, False, sinks, softcap)
    return out


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: VarlenMeta, page_size: int,
            window: int | None, scale: float, sinks: torch.Tensor | None = None,
            softcap: float | None = None) -> torch.Tensor:
    """The prefill group's queries [Tp, Hq, D] (real tokens first, as cu_seqlens_q lays them out) against their
    pages. Returns [Tp, Hq, D]; the padding tokens' rows are zeros."""
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = meta.block_table.shape[0]
    if num_seqs and meta.max_seqlen_q:
        _launch(q, k_cache, v_cache, out, meta.block_table, meta.cu_seqlens_k, meta.cu_seqlens_q,
                meta.cu_seqlens_k, num_seqs, meta.max_seqlen_q, page_size, window, scale, True, sinks, softcap)
    return out
