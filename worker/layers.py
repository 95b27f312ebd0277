"""Tensor-parallel building blocks: sharded linears, vocab-parallel embedding and LM head, RMSNorm (and Gemma's
(1 + w) form).

Each parameterised layer knows which part of a checkpoint tensor is its shard (`shard_of`), reading only
the rows or columns this rank owns through a safetensors slice, and refusing a tensor of the wrong shape.
`Shard` carries the TP coordinates."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from worker.packed_linear import packed_product
from worker.shard_argmax import ShardArgmax, shard_argmax

if TYPE_CHECKING:
    from cluster.host_all_reduce import HostAllReduce


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1
    group: Any = None  # the device group; None at TP=1
    host: HostAllReduce | None = None  # CPU ranks of one host: their shared-memory all-reduce

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (in place when x is contiguous; use the result). Every rank of the device group calls it.
        Eager CPU ranks of one host sum through shared memory; a compiled forward traces gloo's all-reduce."""
        if self.size > 1:
            x = x.contiguous()  # a weight-first product's transposed view (`linear`) is reduced as rows
            if self.host is not None and x.device.type == "cpu" and not torch.compiler.is_compiling():
                return self.host.all_reduce(x)
            dist.all_reduce(x, group=self.group)
        return x


WEIGHT_FIRST_MAX_ROWS = 256  # up to this many rows the CPU multiplies weight-first (`linear`)
WIDE_CHUNK = 2048  # output features a chunk of `wide_linear`


def weight_first(x: torch.Tensor) -> bool:
    """Whether `linear` and `wide_linear` multiply x [T, in] weight-first: on the CPU, up to WEIGHT_FIRST_MAX_ROWS."""
    return x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= WEIGHT_FIRST_MAX_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for x [T, in]. On the CPU in float32, oneDNN's product with the weight packed ahead of time
    (worker/packed_linear.py), in contiguous rows. Otherwise on the CPU (bfloat16), for up to WEIGHT_FIRST_MAX_ROWS
    rows, computed as (W x^T)^T: at decode batch sizes MKL's sgemm runs that product much faster than F.linear's
    x W^T (2 cores, 64 rows: 768 -> 4096 in 4.7 ms against 8.6, 2048 -> 768 in 1.9 against 3.2), and about as fast
    from 256 rows on; the result is then a transposed view: an op that needs contiguous rows (a collective,
    attention's kernel) makes them. Elsewhere, F.linear (cuBLAS picks its own layouts)."""
    y = packed_product(x, weight, bias)
    if y is not None:
        return y
    if not weight_first(x):
        return nn.functional.linear(x, weight, bias)
    y = torch.mm(weight, x.t()).t()
    return y if bias is None else y + bias


def wide_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T in contiguous rows, for a wide W (the LM head's vocab shard). On the CPU in float32, the packed
    weight's product (worker/packed_linear.py). Otherwise on the CPU, for up to WEIGHT_FIRST_MAX_ROWS rows,
    weight-first in chunks of WIDE_CHUNK output features, each copied into its rows while it is still in cache:
    64 rows of a 32000-wide head and their argmax in 40 ms, against 84 for F.linear and 57 for one weight-first
    product (whose transposed result is too large to read back quickly)."""
    packed = packed_product(x, weight)
    if packed is not None:
        return packed
    if not weight_first(x):
        return nn.functional.linear(x, weight)
    out, xt = x.new_empty(x.shape[0], weight.shape[0]), x.t()
    for start in range(0, weight.shape[0], WIDE_CHUNK):
        out[:, start:start + WIDE_CHUNK].copy_(torch.mm(weight[start:start + WIDE_CHUNK], xt).t())
    return out


def shape_of(src: Any) -> tuple[int, ...]:
    return tuple(src.get_shape()) if hasattr(src, "get_shape") else tuple(src.shape)


def expect_shape(src: Any, shape: tuple[int, ...]) -> None:
    """Refuse a checkpoint tensor whose full shape is not the one this model needs."""
    if shape_of(src) != tuple(shape):
        raise ValueError(f"shape {list(shape_of(src))}, expected {list(shape)}")


def read_rows(src: Any, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a checkpoint tensor or safetensors slice, zero-padded past its end; the padding is
    made where the data is (a pushed bucket may live on the GPU), not on the default device."""
    total = shape_of(src)[0]
    part = src[start:min(stop, total)]
    if stop > total:
        pad = part.new_zeros((stop - max(start, total),) + tuple(part.shape[1:]))
        part = torch.cat([part, pad]) if part.shape[0] else pad
    return part


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across ranks; the output stays sharded. `parts`: the checkpoint
    tensors fused into it (q, k, v or gate, up) as name -> (rows on this rank, its first row, rows in all)."""

    def __init__(self, in_features: int, parts: dict[str, tuple[int, int, int]], bias: bool, dtype: torch.dtype):
        super().__init__()
        self.parts, self.in_features = parts, in_features
        rows = [r for r, _, _ in parts.values()]
        self.offsets = dict(zip(parts, accumulate([0] + rows)))  # each part's first row in the fused weight
        self.weight = nn.Parameter(torch.empty(sum(rows), in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(sum(rows), dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def shard_of(self, part: str, kind: str, src: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's destination, its values from `src`): the same for loading and for hot updates."""
        rows, first, total = self.parts[part]
        expect_shape(src, (total, self.in_features) if kind == "weight" else (total,))
        dst = self.weight if kind == "weight" else self.bias
        off = self.offsets[part]
        return dst.data[off:off + rows], read_rows(src, first, first + rows)

    def checkpoint_parts(self) -> list[tuple[str, str]]:
        return [(p, k) for p in self.parts for k in ("weight", "bias") if k == "weight" or self.bias is not None]

    def view(self, part: str, kind: str) -> torch.Tensor:
        """This rank's rows of `part` in the fused parameter (a view of its storage)."""
        off, rows = self.offsets[part], self.parts[part][0]
        return (self.weight if kind == "weight" else self.bias).data[off:off + rows]


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: Shard, dtype: torch.dtype,
                 reduce: bool = True):
        super().__init__()
        assert in_features % shard.size == 0, f"{in_features} features do not split over {shard.size} ranks"
        assert reduce or not bias, "a bias is added after the all-reduce"
        self.shard, self.cols, self.reduce = shard, in_features // shard.size, reduce
        self.weight = nn.Parameter(torch.empty(out_features, self.cols, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank of the device group calls it (one all-reduce; none with reduce=False: the caller sums this
        rank's partial product into others before its own all-reduce)."""
        y = linear(x, self.weight)
        if not self.reduce:
            return y
        y = self.shard.all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def shard_of(self, part: str, kind: str, src: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if kind == "bias":
            expect_shape(src, tuple(self.bias.shape))
            return self.bias.data, src[:]
        expect_shape(src, (self.weight.shape[0], self.cols * self.shard.size))
        start = self.shard.rank * self.cols
        return self.weight.data, src[:, start:start + self.cols]

    def checkpoint_parts(self) -> list[tuple[str, str]]:
        return [("", "weight")] + ([("", "bias")] if self.bias is not None else [])

    def view(self, part: str, kind: str) -> torch.Tensor:
        return (self.weight if kind == "weight" else self.bias).data


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks (the last shard zero-padded); looked up locally, then all-reduced."""

    def __init__(self, vocab_size: int, hidden: int, shard: Shard, dtype: torch.dtype):
        super().__init__()
        self.shard, self.vocab_size, self.rows = shard, vocab_size, -(-vocab_size // shard.size)
        self.start = shard.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Every rank of the device group calls it (one all-reduce when TP > 1)."""
        if self.shard.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = nn.functional.embedding(torch.where(mine, local, 0), self.weight)
        return self.shard.all_reduce(out * mine.unsqueeze(-1).to(out.dtype))

    def shard_of(self, part: str, kind: str, src: Any) -> tuple[torch.Tensor, torch.Tensor]:
        expect_shape(src, (self.vocab_size, self.weight.shape[1]))
        return self.weight.data, read_rows(src, self.start, self.start + self.rows)

    def checkpoint_parts(self) -> list[tuple[str, str]]:
        return [("", "weight")]

    def view(self, part: str, kind: str) -> torch.Tensor:
        """This rank's vocabulary rows without the last shard's zero padding."""
        return self.weight.data[:max(0, min(self.rows, self.vocab_size - self.start))]


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocab-sharded like the embedding; logits are gathered on the driver, or plain greedy
    tokens chosen on the shards (worker/shard_argmax.py)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return wide_linear(hidden, self.weight)

    def gather(self, local_logits: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on rank 0, None elsewhere. Every rank of the device group calls it."""
        if self.shard.size == 1:
            return local_logits[:, :self.vocab_size]
        parts = [torch.empty_like(local_logits) for _ in range(self.shard.size)] if self.shard.rank == 0 else None
        dist.gather(local_logits, parts, dst=0, group=self.shard.group)
        return None if parts is None else torch.cat(parts, dim=-1)[:, :self.vocab_size]

    def argmax(self, local_logits: torch.Tensor) -> ShardArgmax:
        """Each row's greedy token, on every rank. Every rank of the device group calls it."""
        return shard_argmax(local_logits, self.start, self.vocab_size, self.shard.rank, self.shard.size,
                            self.shard.group, self.shard.host)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as transformers' Llama family does."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def shard_of(self, part: str, kind: str, src: Any) -> tuple[torch.Tensor, torch.Tensor]:
        expect_shape(src, tuple(self.weight.shape))
        return self.weight.data, src[:]

    def checkpoint_parts(self) -> list[tuple[str, str]]:
        return [("", "weight")]

    def view(self, part: str, kind: str) -> torch.Tensor:
        return self.weight.data


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint holds w around zero and the scale is (1 + w), applied in float32 before the
    cast back (transformers' Gemma3RMSNorm; Llama's casts first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)
