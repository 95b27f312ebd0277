"""CPU products against weights packed once for oneDNN.

A CPU step multiplies every weight by a few rows (decode) or a chunk of a few hundred (prefill). MKL's sgemm, which
`F.linear` and `torch.mm` run, packs the weight into its panel layout on every call and reads a decode step's
weights at a fraction of what the memory can deliver. oneDNN's inner-product primitive multiplies by a weight
reordered ahead of time into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the layout torch's
Inductor uses for frozen CPU linears) and serves every row count with it. On the 2-core AMD EPYC CI machine
(2026-12-04, float32, weights cycled so none stays in cache): 8 weights of 4096 x 768, 4 rows, 14.6 ms through
MKL's products (`torch.mm`, or MKL's own packed product) against 3.5 ms; 1 row 8.1 against 4.0 ms; 32 rows 14.5
against 9.2; a 32000 x 768 LM head 8 rows 13.9 against 4.2 ms, 256 rows 75 against 58 (benchmarks: docs/throughput-
figures.md). The results equal the plain product to float32 rounding (the summation order differs).

The packed copy is one more copy of each weight (the CPU's weights twice over), made at the first product that
needs it and made again whenever the weight changed: its version counter moves with every in-place write through
the parameter or a view of it; writes the counter does not see (the loader's into `param.data`, a user's through
`named_shards` views, which are views of `param.data`) are covered by `weights_changed`, called by the loader,
after every pause's park on every rank and when a manager starts; a memory release drops the copies
(`forget_packed`). A stacked weight (a MoE layer's experts [E, out, in]) keeps one packed copy per expert
(`index`). Under torch.compile, on CUDA, for other dtypes or without oneDNN, `packed_product` returns None and the
caller multiplies as before. Rank-local: every rank of a step has the same row count, so every rank takes the same
path."""

from __future__ import annotations

import torch
from torch import nn

PACK_ROWS_HINT = 64  # the row count oneDNN's layout is chosen for; it serves every count (1-512 measured)
# a one-row product of a smaller weight stays MKL's matrix-vector product: oneDNN's call costs ~15 us whatever the
# size (384 x 256: 8.7 us against 18.1; 1024 x 256: 26.7 against 23.7; 2048 x 256: 54.7 against 32.4)
ONE_ROW_MIN_ELEMENTS = 1 << 18
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
_generation = 0  # moved by `weights_changed`: every packed copy made before is stale


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `packed_product` multiplies x [T, in] by weight: on the CPU, float32, eager, a weight to read."""
    return (_ONEDNN and x.device.type == "cpu" and x.dim() == 2 and x.dtype == weight.dtype == torch.float32
            and weight.numel() > 0 and weight.is_contiguous() and not torch.compiler.is_compiling())


def _packed(weight: torch.Tensor, index: int | None) -> torch.Tensor:
    """weight (or weight[index]) in oneDNN's blocked layout, packed now if it changed since it was last packed."""
    key = (_generation, weight._version, weight.data_ptr())
    cached = getattr(weight, "_lockstep_packed", None)
    if cached is None or cached[0] != key:
        cached = (key, {})
        weight._lockstep_packed = cached
    packed = cached[1].get(index)
    if packed is None:
        rows = weight.detach() if index is None else weight.detach()[index]
        packed = cached[1][index] = torch.ops.mkldnn._reorder_linear_weight(rows, PACK_ROWS_HINT)
    return packed


def packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   index: int | None = None) -> torch.Tensor | None:
    """x W^T (+ b) in contiguous rows for x [T, in] on the CPU in float32, through W (or W[index] of a stacked
    weight) packed for oneDNN; None where that does not apply (the caller then multiplies as usual)."""
    if not applies(x, weight):
        return None
    elements = weight.numel() if index is None else weight.numel() // weight.shape[0]
    if x.shape[0] == 1 and elements < ONE_ROW_MIN_ELEMENTS:
        return None
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), _packed(weight, index), bias, "none", [], "")


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
