"""worker/packed_linear.py: decode-sized CPU products against MKL-packed weights equal the plain product, follow
every in-place change of the weight (through the parameter or a view, as weight updates and named shards write),
are dropped with a memory release, and step aside where they do not apply."""

from __future__ import annotations

import torch
from torch import nn

from worker import packed_linear
from worker.layers import linear, wide_linear
from worker.packed_linear import MIN_PACKED_ROWS, PACKED_ROWS, forget_packed, packed_product



def test_the_pinned_cpu_torch_has_mkls_packed_product():
    # torch==2.13.0's x86 CPU wheel (README): without MKL every product would take the unpacked path
    assert packed_linear._MKL


def test_equal_to_the_plain_product_for_every_row_count_up_to_the_packed_one():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(300, 64))
    for rows in range(1, PACKED_ROWS + 1):
        x = torch.randn(rows, 64)
        got = packed_product(x, w)
        if rows < MIN_PACKED_ROWS:  # one row: the matrix-vector product, below
            assert got is None
        else:
            assert got is not None and got.shape == (rows, 300) and got.is_contiguous()
            torch.testing.assert_close(got, x @ w.detach().t(), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(linear(x, w, torch.ones(300)), x @ w.detach().t() + 1, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(wide_linear(x, w), x @ w.detach().t(), rtol=1e-5, atol=1e-4)


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
    assert packed_product(torch.randn(PACKED_ROWS + 1, 16), w) is None  # a prefill's rows: the usual product
    assert packed_product(torch.randn(1, 16), w) is None  # one decode row: gemv, nothing to pack or pad
    assert packed_product(torch.randn(2, 16, dtype=torch.float64), w.double()) is None
    assert packed_product(torch.randn(2, 16), w.t().contiguous().t()) is None  # not a row-major weight
    assert packed_product(torch.randn(2, 16), torch.empty(0, 16)) is None  # released weights
