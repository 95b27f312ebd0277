"""Decode-sized CPU products against weights packed once for MKL.

At decode batch sizes a CPU step reads every weight once and multiplies it by a few rows. MKL's sgemm packs the
weight into its panel layout on every call, so a product of up to 16 rows runs at about half of what the memory
can deliver (2 cores: 4 rows x a 4096 x 768 weight at 28 GB/s; the packed product at 52 GB/s, a dot product at
55). `torch.ops.mkl._mkl_linear` multiplies by a weight packed ahead of time (`_mkl_reorder_linear_weight`), for
exactly the row count it was packed for: so a product of up to PACKED_ROWS rows pads them to PACKED_ROWS and uses
the weight packed for that count. A 5-row decode step of models/small: 33 ms -> 22 ms. One row is left to the
usual product, which MKL runs as a matrix-vector product (no packing, no padding to 8 rows): batch-1 decode of a
4-layer 256-wide llama at 16-45 ms a token against 68-147 padded, on a loaded 2-core machine (2026-12-04).

The packed copy is one more copy of each weight that a decode step multiplies (the CPU's weights twice over), made
at the first product that needs it and made again whenever the weight changed: its version counter moves with
every in-place write through the parameter or a view of it; writes the counter does not see (the loader's into
`param.data`, a user's through `named_shards` views, which are views of `param.data`) are covered by
`weights_changed`, called by the loader, after every pause's park on every rank and when a manager starts; a
memory release drops the copies (`forget_packed`). Under torch.compile, on CUDA, for other
dtypes or without MKL, `packed_product` returns None and the caller multiplies as before. Rank-local: every rank
of a step has the same row count, so every rank takes the same path."""

from __future__ import annotations

import torch
from torch import nn

PACKED_ROWS = 8  # products of at most this many rows use the packed weight (padded to it)
MIN_PACKED_ROWS = 2  # one row is a matrix-vector product: MKL's gemv packs nothing and pads nothing (faster alone)
_MKL = bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl, "_mkl_linear")
_generation = 0  # moved by `weights_changed`: every packed copy made before is stale


def packed_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x W^T for x [T, in] with MIN_PACKED_ROWS <= T <= PACKED_ROWS on the CPU in float32, through W packed for
    MKL; None where that does not apply (the caller then multiplies as usual)."""
    if not (_MKL and x.device.type == "cpu" and x.dim() == 2 and MIN_PACKED_ROWS <= x.shape[0] <= PACKED_ROWS
            and x.dtype == weight.dtype == torch.float32 and weight.numel() > 0 and weight.is_contiguous()
            and not torch.compiler.is_compiling()):
        return None
    key = (_generation, weight._version, weight.data_ptr())
    cached = getattr(weight, "_lockstep_packed", None)
    if cached is None or cached[0] != key:
        cached = (key, torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACKED_ROWS))
        weight._lockstep_packed = cached
    rows = x.shape[0]
    if rows < PACKED_ROWS:
        padded = x.new_zeros(PACKED_ROWS, x.shape[1])
        padded[:rows] = x
        x = padded
    return torch.ops.mkl._mkl_linear(x.contiguous(), cached[1], weight.detach(), None, PACKED_ROWS)[:rows]


def weights_changed() -> None:
    """Weights were written where their version counters do not see it (a loader copies into `param.data`): every
    packed copy is made again at its next product."""
    global _generation
    _generation += 1


def forget_packed(model: nn.Module) -> None:
    """Drop every packed copy (a memory release frees them with the weights; the next product packs again)."""
    for p in model.parameters():
        if hasattr(p, "_lockstep_packed"):
            del p._lockstep_packed
