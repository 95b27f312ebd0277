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
float32 inputs multiply in IEEE float32 (no TF32). The weights are read through strides, so transformers' transposed
gpt-oss layout (`gate_up` [E, H, 2R], gate and up columns interleaved; `down` [E, R, H]) runs as it is stored, and
gpt-oss's experts add their biases (gate/up before the activation, down before the routing weight) and clamp:
h = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit) (worker/clamped_experts.py).

With TRITON_INTERPRET=1 set before triton is first imported the kernel runs on CPU tensors through Triton's
interpreter: tests/test_triton_experts.py checks it so, in a child process, against `Experts._grouped`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.triton_attention import INTERPRETED, dot_float32

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, b_ptr, out_ptr, order_ptr, offsets_ptr, counts_ptr, route_ptr,
                    stride_a, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_out, N, K, UP_OFF,
                    B_UP_OFF, limit, alpha,
                    TOP_K: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
                    PRECISION: tl.constexpr, WIDEN: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One (expert, row block, column block). GATED: rows read x by token and write h by sorted position; else
    rows read h by sorted position and write y by pair, scaled by the pair's routing weight. Weight element
    (output n, input k) of expert e sits at e * stride_we + n * stride_wn + k * stride_wk (the up half UP_OFF
    further); bias element n at e * stride_be + n * stride_bn (the up half B_UP_OFF further)."""
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
        acc += dot_float32(a, tl.load(w + kk[:, None] * stride_wk, mask=w_mask, other=0.0), PRECISION, WIDEN)
        if GATED:  # the up weights sit UP_OFF elements after the gate's
            acc_up += dot_float32(a, tl.load(w + UP_OFF + kk[:, None] * stride_wk, mask=w_mask, other=0.0),
                                  PRECISION, WIDEN)
    if HAS_BIAS:
        b = b_ptr + e.to(tl.int64) * stride_be + cols * stride_bn
        acc += tl.load(b, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b + B_UP_OFF, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if CLAMPED:
            g = tl.minimum(acc, limit)
            out = (tl.minimum(tl.maximum(acc_up, -limit), limit) + 1.0) * (g * tl.sigmoid(g * alpha))
        else:
            out = acc * tl.sigmoid(acc) * acc_up
        o_row = s
    else:
        out = acc * tl.load(route_ptr + pair, mask=live, other=0.0)[:, None]
        o_row = pair
    tl.store(out_ptr + o_row[:, None].to(tl.int64) * stride_out + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=live[:, None] & (cols[None, :] < N))


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
            counts: torch.Tensor, route: torch.Tensor, n: int, top_k: int, gated: bool, strides: tuple[int, int, int],
            bias: torch.Tensor | None, bias_strides: tuple[int, int, int], clamp: tuple[float, float] | None) -> None:
    """strides: (element stride along outputs, along inputs, to the up half); bias_strides: the bias's (expert,
    output, up half)."""
    grid = (w.shape[0], triton.cdiv(order.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N))
    limit, alpha = clamp or (0.0, 0.0)
    _grouped_kernel[grid](
        a, w, w if bias is None else bias, out, order, offsets, counts, route, a.stride(0), w.stride(0),
        strides[0], strides[1], bias_strides[0], bias_strides[1], out.stride(0), n, a.shape[1], strides[2],
        bias_strides[2], limit, alpha, TOP_K=top_k, GATED=gated, HAS_BIAS=bias is not None,
        CLAMPED=clamp is not None, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        WIDEN=INTERPRETED and a.dtype == torch.bfloat16, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, order: torch.Tensor,
                    offsets: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor, transposed: bool = False,
                    gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                    clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2R, H], down [E, H, R] (this rank's E experts; `transposed`: transformers' gpt-oss
    layout, gate_up [E, H, 2R] with gate and up columns interleaved, down [E, R, H]); order [T * k] pair indexes
    sorted by expert (pair p = token p // k, choice p % k; pairs of no local expert last); offsets, counts [E] int32
    or int64 (a local expert's pairs are order[offsets[e]:offsets[e] + counts[e]]); weights [T, k] float32.
    `gate_up_bias` [E, 2R] (interleaved as the weight), `down_bias` [E, H]: added before the activation and before
    the routing weight; `clamp`: (limit, alpha) of the clamped SwiGLU, else SiLU. Returns this rank's part of the
    output [T, H] in x's dtype. Capturable: the grid depends on the shapes only."""
    t, k = weights.shape
    hidden = x.shape[1]
    rows = (gate_up.shape[2] if transposed else gate_up.shape[1]) // 2
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    route = weights.reshape(-1).contiguous().float()
    h = torch.empty(t * k, rows, dtype=x.dtype, device=x.device)
    y = torch.zeros(t * k, hidden, dtype=x.dtype, device=x.device)
    gate_strides = (2, 2 * rows, 1) if transposed else (hidden, 1, rows * hidden)
    down_strides = (1, hidden, 0) if transposed else (rows, 1, 0)
    gate_bias = None if gate_up_bias is None else gate_up_bias.contiguous()
    down_b = None if down_bias is None else down_bias.contiguous()
    if t:
        _launch(x, gate_up, h, order, offsets, counts, route, rows, k, True, gate_strides, gate_bias,
                (2 * rows, 2, 1) if transposed else (2 * rows, 1, rows), clamp)
        _launch(h, down, y, order, offsets, counts, route, hidden, k, False, down_strides, down_b,
                (hidden, 1, 0), None)
    return y.view(t, k, hidden).sum(dim=1)
