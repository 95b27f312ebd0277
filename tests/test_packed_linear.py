"""worker/packed_linear.py: CPU products against oneDNN-packed weights equal the plain product, follow
every in-place change of the weight (through the parameter or a view, as weight updates and named shards write),
are dropped with a memory release, and step aside where they do not apply."""

from __future__ import annotations

import torch
from torch import nn

from worker import packed_linear
from worker.layers import linear, wide_linear
from worker.experts import expert_product
from worker.packed_linear import forget_packed, packed_product



def test_the_pinned_cpu_torch_has_onednns_packed_product():
    # torch==2.13.0's x86 CPU wheel (README): without oneDNN every product would take the unpacked path
    assert packed_linear._ONEDNN


def test_equal_to_the_plain_product_for_every_row_count():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(300, 64), requires_grad=False)
    b = torch.randn(300)
    for rows in (1, 2, 3, 5, 8, 9, 17, 64, 257, 600):
        x = torch.randn(rows, 64)
        want = x @ w.detach().t()
        got = packed_product(x, w)
        if rows == 1:  # a small weight's one-row product: MKL's matrix-vector product (below)
            assert got is None
        else:
            assert got is not None and got.shape == (rows, 300) and got.is_contiguous()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(packed_product(x, w, b), want + b, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(linear(x, w, torch.ones(300)), want + 1, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(wide_linear(x, w), want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(linear(x.t().contiguous().t(), w), want, rtol=1e-5, atol=1e-4)  # column-major x


def test_one_row_is_packed_only_for_a_weight_big_enough_to_pay():
    torch.manual_seed(3)
    big = nn.Parameter(torch.randn(packed_linear.ONE_ROW_MIN_ELEMENTS // 256, 256), requires_grad=False)
    x = torch.randn(1, 256)
    got = packed_product(x, big)
    assert got is not None and got.shape == (1, big.shape[0])
    torch.testing.assert_close(got, x @ big.detach().t(), rtol=1e-5, atol=1e-4)
    assert packed_product(x, big[:-1].contiguous()) is None


def test_a_stacked_weight_packs_each_expert_apart():
    torch.manual_seed(2)
    stacked = nn.Parameter(torch.randn(4, 48, 32), requires_grad=False)
    x = torch.randn(7, 32)
    for e in range(4):
        torch.testing.assert_close(expert_product(x, stacked, e), x @ stacked[e].t(), rtol=1e-5, atol=1e-4)
    assert sorted(stacked._lockstep_packed[1]) == [0, 1, 2, 3]
    with torch.no_grad():
        stacked[2].mul_(-1)  # one expert written in place (a partial update): every copy is stale
    for e in range(4):
        torch.testing.assert_close(expert_product(x, stacked, e), x @ stacked[e].t(), rtol=1e-5, atol=1e-4)


def test_an_in_place_change_is_seen_at_the_next_product():
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(128, 32))
    x = torch.randn(3, 32)
    packed_product(x, w)
    with torch.no_grad():
        w.mul_(2)  # through the parameter
    torch.testing.assert_close(packed_product(x, w), x @ w.detach().t(), rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        w[:64].copy_(torch.randn(64, 32))  # through a view (loader.apply writes into views of the parameters)
    torch.testing.assert_close(packed_product(x, w), x @ w.detach().t(), rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        w.data.copy_(torch.randn(128, 32))  # the loader's way: `param.data` has a version counter of its own
    assert not torch.equal(packed_product(x, w), x @ w.detach().t())  # unseen, hence weights_changed:
    packed_linear.weights_changed()
    torch.testing.assert_close(packed_product(x, w), x @ w.detach().t(), rtol=1e-5, atol=1e-4)
    model = nn.Linear(32, 128, bias=False)
    model.weight = w
    forget_packed(model)
    assert not hasattr(w, "_lockstep_packed")
    torch.testing.assert_close(packed_product(x, w), x @ w.detach().t(), rtol=1e-5, atol=1e-4)
    assert hasattr(w, "_lockstep_packed")


def test_it_steps_aside_where_it_does_not_apply():
    w = torch.randn(64, 16)
    assert packed_product(torch.randn(2, 16, dtype=torch.float64), w.double()) is None
    assert packed_product(torch.randn(2, 16, dtype=torch.bfloat16), w.bfloat16()) is None
    assert packed_product(torch.randn(2, 16), w.t().contiguous().t()) is None  # not a row-major weight
    assert packed_product(torch.randn(2, 16), torch.empty(0, 16)) is None  # released weights
    assert packed_product(torch.randn(2, 3, 16), w) is None  # rows flattened by the caller
