"""The grouped-expert Triton kernel (worker/triton_experts.py), run on CPU tensors through Triton's interpreter,
against `Experts._grouped` (the CPU path, itself checked against transformers by tests/test_moe.py) in float64:
4, 8 and 16 experts, top-k 1, 2 and 8, experts with no token, one token, padding rows (zero hidden states, routed
like any row, as the runner's padding is), an expert with more rows than one row block, sizes that are not a
multiple of the tiles, this rank's half of the experts (expert-parallel: pairs of the other rank's experts are
skipped) and a tensor-parallel slice, float32 and bfloat16; and gpt-oss's experts (worker/clamped_experts.py:
transformers' transposed layout read through strides, interleaved gate/up, biases, a clamp the values reach) against
`ClampedExperts._grouped`, one rank holding all, a tensor-parallel rank that adds no down bias, an expert-parallel
rank.

As tests/test_triton_attention.py: Triton reads TRITON_INTERPRET when it is imported, so the kernels run in ONE
child process started with TRITON_INTERPRET=1 (this module as a script; jobs in and results out through
torch.save), the references here."""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from worker.clamped_experts import ClampedExperts
from worker.experts import ExpertPlacement, Experts, sort_by_expert
from worker.layers import Shard
from tests.triton_interpreter import run_interpreted

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    experts: int
    top_k: int
    tokens: int  # real rows
    padding: int = 0  # zero rows after them
    hidden: int = 32
    inter: int = 32
    empty: tuple[int, ...] = ()  # experts no token picks
    expert_parallel: bool = False  # rank 1 of 2 holds experts [E / 2, E); else tensor-parallel rank 0 of `tp`
    tp: int = 1
    clamped: bool = False  # gpt-oss's experts (limit 0.5, alpha 1.702), tensor-parallel rank `tp - 1`

    def placement(self) -> ExpertPlacement:
        if self.expert_parallel:
            return ExpertPlacement.expert_parallel(self.experts, self.inter, Shard(rank=1, size=2))
        rank = self.tp - 1 if self.clamped else 0
        return ExpertPlacement.tensor_parallel(self.experts, self.inter, Shard(rank=rank, size=self.tp))

    def module(self, dtype: torch.dtype) -> Experts:
        if self.clamped:
            return ClampedExperts(self.hidden, self.placement(), 0.5, 1.702, dtype)
        return Experts(self.hidden, self.placement(), dtype)


CASES = {
    "f32-e4-k1-one-token": Case(torch.float32, 4, 1, 1),
    "f32-e8-k2-empty-padding": Case(torch.float32, 8, 2, 37, padding=5, empty=(3, 5)),
    "f32-e16-k8-ragged": Case(torch.float32, 16, 8, 20, hidden=24, inter=40, empty=(0,)),
    "f32-e8-k2-ep-rank1": Case(torch.float32, 8, 2, 13, padding=3, expert_parallel=True, empty=(6,)),
    "f32-e4-k2-tp-slice": Case(torch.float32, 4, 2, 9, inter=48, tp=2),
    "bf16-e8-k2-padding": Case(torch.bfloat16, 8, 2, 33, padding=7, empty=(1,)),
    "bf16-e16-k8-one-token": Case(torch.bfloat16, 16, 8, 1, hidden=48),
    "clamped-f32-e8-k4-empty-padding": Case(torch.float32, 8, 4, 21, padding=3, inter=40, empty=(2,), clamped=True),
    "clamped-f32-e8-k2-tp-rank1": Case(torch.float32, 8, 2, 11, inter=48, tp=2, clamped=True),
    "clamped-f32-e8-k2-ep-rank1": Case(torch.float32, 8, 2, 13, expert_parallel=True, clamped=True),
    "clamped-bf16-e4-k2": Case(torch.bfloat16, 4, 2, 17, clamped=True),
}


def inputs(case: Case) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(x [T, H], this rank's expert parameters by name, experts [T, k], weights [T, k] float32), T = tokens +
    padding."""
    gen = torch.Generator().manual_seed(case.experts * 100 + case.top_k * 10 + case.tokens)
    t = case.tokens + case.padding
    x = torch.randn(t, case.hidden, generator=gen)
    x[case.tokens:] = 0.0
    scores = torch.rand(t, case.experts, generator=gen)
    scores[:, list(case.empty)] = -1.0
    experts = scores.topk(case.top_k, dim=-1)[1]
    weights = torch.rand(t, case.top_k, generator=gen)
    params = {}
    for name, p in case.module(torch.float32).named_parameters():  # products of about unit size
        fan_in = {"gate_up": case.hidden, "down": case.placement().inter_rows}.get(name, 1)  # biases: 1
        params[name] = (torch.randn(p.shape, generator=gen) * fan_in ** -0.5).to(case.dtype)
    return x.to(case.dtype), params, experts, weights


def loaded(case: Case, params: dict[str, torch.Tensor], dtype: torch.dtype) -> Experts:
    module = case.module(dtype)
    for name, p in module.named_parameters():
        p.data.copy_(params[name])
    return module


def run_kernel(case: Case) -> torch.Tensor:
    from worker.triton_experts import grouped_experts

    x, params, experts, weights = inputs(case)
    module = loaded(case, params, case.dtype)
    order, offsets, counts = sort_by_expert(experts, case.placement())
    return grouped_experts(x, order=order, offsets=offsets, counts=counts, weights=weights,
                           **module.grouped_kernel())


def reference(case: Case) -> torch.Tensor:
    """The CPU path in float64 on the same (rounded) weights and inputs."""
    x, params, experts, weights = inputs(case)
    return loaded(case, params, torch.float64)._grouped(x.double(), experts, weights.double())


def run_jobs(folder: str) -> None:
    """The child's side: TRITON_INTERPRET=1 is set before anything imports triton."""
    assert os.environ.get("TRITON_INTERPRET") == "1" and "triton" not in sys.modules
    from worker import triton_experts

    assert triton_experts.INTERPRETED
    torch.save({name: run_kernel(case) for name, case in CASES.items()}, Path(folder) / "out.pt")


@pytest.fixture(scope="module")
def results() -> dict[str, torch.Tensor]:
    """Every case's kernel output, from one interpreter process."""
    with tempfile.TemporaryDirectory() as folder:
        return run_interpreted("tests.test_triton_experts", Path(folder))  # type: ignore[return-value]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_the_grouped_reference(results, name):
    case = CASES[name]
    out, want = results[name], reference(case)
    assert out.shape == want.shape and out.dtype == case.dtype
    tol = TOL[case.dtype]
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    if not case.clamped:  # padding rows (zero states) stay zero, and nothing spills into them (biases: not zero)
        assert out[case.tokens:].eq(0).all()
    if case.clamped and not case.expert_parallel:
        x, params, *_ = inputs(case)
        gate = (x.float() @ params["gate_up"].float() + params["gate_up_bias"].float()[:, None])[..., ::2]
        assert (gate > 0.5).any() and case.module(case.dtype).adds_down_bias == (case.tp == 1)
    if case.expert_parallel:  # tokens none of whose choices is held here get nothing from this rank
        held = case.placement().holds
        none_here = [t for t in range(case.tokens) if not any(held(e) for e in inputs(case)[2][t].tolist())]
        assert none_here and out[none_here].eq(0).all()


def test_sort_by_expert_orders_pairs_on_the_device():
    """Stable order by local expert, other ranks' experts last, offsets and counts of the local experts only."""
    experts = torch.tensor([[5, 1], [2, 5], [7, 4], [5, 6]])
    order, offsets, counts = sort_by_expert(experts, ExpertPlacement.expert_parallel(8, 4, Shard(rank=1, size=2)))
    assert counts.tolist() == [1, 3, 1, 1] and offsets.tolist() == [0, 1, 4, 5]
    assert order.tolist()[:6] == [5, 0, 3, 6, 7, 4] and sorted(order.tolist()[6:]) == [1, 2]


if __name__ == "__main__":
    run_jobs(sys.argv[1])
