"""flash-attn's paged kernels, and the host-side metadata its varlen kernel needs (docs/architecture.md,
"Attention"); used where `cluster.config.attention_decision` picks "flash_attn". The cache is viewed as pages
[blocks, page, Hkv, D] and both kernels read a sequence's keys through its block table in place. The Triton path
(worker/triton_attention.py) takes the same layout and the same arguments.

A layer's score terms (worker/attention.py `ScoreTerms`): the softcap is flash-attn's own `softcap` argument (it
caps after the scale, before the mask, as transformers does); flash-attn takes no sinks, so with sinks the kernels
also return each row's log-sum-exp of its visible scores, and the output is scaled by the share the keys keep once
the head's sink joins the denominator: exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink) (`_sunk`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class VarlenMeta:
    """What `flash_attn_varlen_func` needs for the prefill group: host arrays from `varlen_metadata`, then (in
    `AttnMeta.pre_flash`) views of the static buffers they were copied into."""

    cu_seqlens_q: torch.Tensor | np.ndarray  # [Bp + 1] int32
    cu_seqlens_k: torch.Tensor | np.ndarray  # [Bp + 1] int32
    block_table: torch.Tensor | np.ndarray  # [Bp, NB] int32, NB = max_blocks_per_request (padded: scratch block)
    max_seqlen_q: int
    max_seqlen_k: int
    num_tokens: int  # real prefill tokens; the padding tokens after them get zeros


def varlen_metadata(q_lens: np.ndarray, kv_lens: np.ndarray, tables: np.ndarray, width: int,
                    scratch_block: int) -> VarlenMeta:
    """The prefill group's varlen arguments, on the host. q_lens, kv_lens: [Bp]; tables: [Bp, <= width]."""
    q_lens, kv_lens = np.asarray(q_lens, np.int64), np.asarray(kv_lens, np.int64)
    table = np.full((len(q_lens), width), scratch_block, np.int32)
    table[:, :tables.shape[1]] = tables
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    return VarlenMeta(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, block_table=table, max_seqlen_q=int(q_lens.max(initial=0)),
                      max_seqlen_k=int(kv_lens.max(initial=0)), num_tokens=int(cu_q[-1]))


def _window(window: int | None) -> tuple[int, int]:
    """flash-attn's (left, right) window: a key is visible when p - j < window, i.e. window - 1 to the left."""
    return (window - 1, 0) if window else (-1, -1)


def _pages(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    return cache.view(-1, page_size, cache.shape[1], cache.shape[2])


def _sunk(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """out [T, Hq, D] normalised over the keys alone, lse [T, Hq] (float32) -> the output with each head's sink
    [Hq] in the softmax denominator. A row that saw no key keeps its zeros (whatever infinity its lse is)."""
    return out * torch.sigmoid(lse - sinks.float()).unsqueeze(-1).to(out.dtype)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
           kv_lens: torch.Tensor, page_size: int, window: int | None, scale: float,
           sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """One query per sequence against its pages, read in place. q: [Bd, Hq, D]. Capturable (no host sync)."""
    from flash_attn import flash_attn_with_kvcache

    res = flash_attn_with_kvcache(q.unsqueeze(1), _pages(k_cache, page_size), _pages(v_cache, page_size),
                                  cache_seqlens=kv_lens, block_table=block_table, softmax_scale=scale,
                                  causal=True, window_size=_window(window), softcap=softcap or 0.0,
                                  return_softmax_lse=sinks is not None)
    if sinks is None:
        return res.squeeze(1)
    out, lse = res  # lse: [Bd, Hq, 1]
    return _sunk(out.squeeze(1), lse.squeeze(-1), sinks)


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: VarlenMeta, page_size: int,
            window: int | None, scale: float, sinks: torch.Tensor | None = None,
            softcap: float | None = None) -> torch.Tensor:
    """The prefill group's queries [Tp, Hq, D] (real tokens first) against their pages. Returns [Tp, Hq, D];
    the padding tokens' rows are zeros (flash-attn leaves rows past cu_seqlens_q[-1] unwritten)."""
    from flash_attn import flash_attn_varlen_func

    t = meta.num_tokens
    res = flash_attn_varlen_func(q[:t], _pages(k_cache, page_size), _pages(v_cache, page_size),
                                 cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                                 max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                                 softmax_scale=scale, causal=True, window_size=_window(window),
                                 softcap=softcap or 0.0, block_table=meta.block_table,
                                 return_attn_probs=sinks is not None)
    if sinks is not None:
        res, lse = res[0], res[1]  # lse: [Hq, t] (varlen: heads first, the real tokens back to back)
        res = _sunk(res, lse[:, :t].t(), sinks)
    if t == q.shape[0]:
        return res
    return torch.cat([res, q.new_zeros(q.shape[0] - t, q.shape[1], q.shape[2])])
