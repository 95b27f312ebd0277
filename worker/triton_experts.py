"""Grouped expert compute in Triton, for CUDA (docs/architecture.md, "Experts"): the (token, choice) pairs sorted by
expert, each expert's rows multiplied by its own weights, with no host sync, so a MoE layer runs inside a decode
CUDA graph and a compiled forward.

The caller sorts the pairs on the device (`order`: pair indexes, expert by expert; `offsets`, `counts`: each local
expert's first sorted position and its number of pairs). The grid is static: (local experts, row blocks of the
padded token count x top-k, column blocks); a program reads its expert's count on the device and does nothing past
it, so the same launch serves every routing. Two launches of one kernel:

1. gated: h[s] = silu(x[token of pair s] @ gate^T) * (x[token of pair s] @ up^T), rows of `gate_up` [E, 2R, H];
2. down: y[pair of s] = (h[s] @ down^T) * weight of that pair, `down` [E, H, R];

then out[t] = sum over t's k choices of y (pairs of other ranks' experts stay zero). Products accumulate in float32;
float32 inputs multiply in IEEE float32 (no TF32).

With TRITON_INTERPRET=1 set before triton is first imported the kernel runs on CPU tensors through Triton's
interpreter: tests/test_triton_experts.py checks it so, in a child process, against `Experts._grouped`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.triton_attention import INTERPRETED, dot_float32

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, out_ptr, order_ptr, offsets_ptr, counts_ptr, route_ptr,
                    stride_a, stride_we, stride_wn, stride_out, N, K, W_HALF,
                    TOP_K: tl.constexpr, GATED: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (expert, row block, column block). GATED: rows read x by token and write h by sorted position; else
    rows read h by sorted position and write y by pair, scaled by the pair's routing weight."""
    e = tl.program_id(0)
    within = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = within < tl.load(counts_ptr + e)
    s = tl.load(offsets_ptr + e) + within  # sorted positions
    pair = tl.load(order_ptr + s, mask=live, other=0)
    a_row = (pair // TOP_K) if GATED else s
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = w_ptr + e.to(tl.int64) * stride_we + cols[None, :] * stride_wn  # W^T tile: [BLOCK_K, BLOCK_N]
    k_end = tl.where(tl.program_id(1) * BLOCK_M < tl.load(counts_ptr + e), K, 0)  # an empty block loads nothing
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, k_end, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_row[:, None].to(tl.int64) * stride_a + kk[None, :],
                    mask=live[:, None] & (kk[None, :] < K), other=0.0)
        w_mask = (kk[:, None] < K) & (cols[None, :] < N)
        acc += dot_float32(a, tl.load(w + kk[:, None], mask=w_mask, other=0.0), PRECISION, WIDEN)
        if GATED:  # the up rows sit W_HALF rows below the gate rows
            acc_up += dot_float32(a, tl.load(w + W_HALF * stride_wn + kk[:, None], mask=w_mask, other=0.0),
                                  PRECISION, WIDEN)
    if GATED:
        out = acc * tl.sigmoid(acc) * acc_up
        o_row = s
    else:
        out = acc * tl.load(route_ptr + pair, mask=live, other=0.0)[:, None]
        o_row = pair
    tl.store(out_ptr + o_row[:, None].to(tl.int64) * stride_out + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=live[:, None] & (cols[None, :] < N))


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
            counts: torch.Tensor, route: torch.Tensor, n: int, top_k: int, gated: bool) -> None:
    grid = (w.shape[0], triton.cdiv(order.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
    _grouped_kernel[grid](
        a, w, out, order, offsets, counts, route, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        n, a.shape[1], n, TOP_K=top_k, GATED=gated, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        WIDEN=INTERPRETED and a.dtype == torch.bfloat16, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, order: torch.Tensor,
                    offsets: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2R, H], down [E, H, R] (this rank's E experts); order [T * k] pair indexes sorted by
    expert (pair p = token p // k, choice p % k; pairs of no local expert last); offsets, counts [E] int32 or int64
    (a local expert's pairs are order[offsets[e]:offsets[e] + counts[e]]); weights [T, k] float32. Returns this
    rank's part of the output [T, H] in x's dtype. Capturable: the grid depends on the shapes only."""
    t, k = weights.shape
    rows, hidden = gate_up.shape[1] // 2, x.shape[1]
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    route = weights.reshape(-1).contiguous().float()
    h = torch.empty(t * k, rows, dtype=x.dtype, device=x.device)
    y = torch.zeros(t * k, hidden, dtype=x.dtype, device=x.device)
    if t:
        _launch(x, gate_up, h, order, offsets, counts, route, rows, k, gated=True)
        _launch(h, down, y, order, offsets, counts, route, hidden, k, gated=False)
    return y.view(t, k, hidden).sum(dim=1)
