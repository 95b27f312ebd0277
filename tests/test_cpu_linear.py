"""The CPU's weight-first products (worker/layers.py `linear`, `wide_linear`) compute what F.linear does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.layers import WEIGHT_FIRST_MAX_ROWS, WIDE_CHUNK, linear, wide_linear

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64, WEIGHT_FIRST_MAX_ROWS, WEIGHT_FIRST_MAX_ROWS + 1])
def test_linear_matches_f_linear(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(160, 96, generator=g).to(dtype)
    b = torch.randn(160, generator=g).to(dtype)
    for bias in (None, b):
        want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        got = linear(x, w, bias)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=TOL[dtype], atol=TOL[dtype] * 10)


@pytest.mark.parametrize("rows", [1, 64, WEIGHT_FIRST_MAX_ROWS + 1])
def test_wide_linear_matches_f_linear_in_contiguous_rows(rows):
    """A width that is not a whole number of chunks: the last chunk is short."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g)
    w = torch.randn(2 * WIDE_CHUNK + 123, 64, generator=g)
    got = wide_linear(x, w)
    assert got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-4, atol=1e-3)
    assert torch.equal(got.argmax(-1), F.linear(x, w).argmax(-1))
