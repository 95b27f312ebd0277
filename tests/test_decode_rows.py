"""Eager CPU decode rows (worker/attention.py `_decode_rows`, AttnMeta.dec_rows): each row attends to views of its
own pages at its own length, and gives what the padded, masked gather gives for the same plan, with rows of one
page and of several, a sliding window, GQA and padding rows; a step laid out for a burst, a graph bucket or a
compiled forward keeps the key-slot lists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.plan import StepPlan
from tests.test_step_inputs import rc_for
from worker.attention import paged_attention
from worker.step_inputs import StaticBuffers, prepare_step

PAGE = 16
HQ, HKV, D = 6, 2, 8


def plan_of(lens: list[int], burst: int = 1) -> StepPlan:
    n, width = len(lens), 4
    tables = np.random.default_rng(1).permutation(n * width).astype(np.int32).reshape(n, width)
    return StepPlan(input_ids=np.arange(3, 3 + n, dtype=np.int32), q_lens=np.ones(n, np.int32),
                    kv_lens=np.array(lens, np.int32), sample=np.ones(n, np.int32), block_tables=tables, burst=burst)


@pytest.mark.parametrize("window", [None, 5])
def test_rows_read_in_place_equal_the_padded_gather(window):
    rc = rc_for(False)
    rc.page_size = PAGE
    lens = [1, 7, 16, 17, 40]  # one key, inside a page, a full page, one past it, three pages
    plan = plan_of(lens)
    scratch_block = 20
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn((scratch_block + 1) * PAGE, HKV, D, generator=gen)
    v_cache = torch.randn((scratch_block + 1) * PAGE, HKV, D, generator=gen)
    q = torch.randn(8, HQ, D, generator=gen)  # 5 rows padded to 8
    out = {}
    for rows in (False, True):
        _, meta, _ = prepare_step(rc, StaticBuffers(rc, torch.device("cpu")), plan, scratch_block, None, rows)
        assert (meta.dec_rows is not None) == rows
        if rows:
            assert meta.dec_kv_slots.shape == (8, 0)
            assert meta.dec_rows == [(n, plan.block_tables[i, :-(-n // PAGE)].tolist()) for i, n in enumerate(lens)]
        out[rows] = paged_attention(q, k_cache, v_cache, meta, window, D ** -0.5)
    assert out[True].shape == out[False].shape == (8, HQ, D)
    torch.testing.assert_close(out[True][:5], out[False][:5], rtol=1e-5, atol=1e-6)
    assert not out[True][5:].any()  # padding rows: zeros, never read


def test_bursts_buckets_and_compiled_forwards_keep_key_slot_lists():
    rc = rc_for(False)
    rc.page_size = PAGE
    buf = StaticBuffers(rc, torch.device("cpu"))
    _, meta, _ = prepare_step(rc, buf, plan_of([5, 9], burst=3), 20, None, True)
    assert meta.dec_rows is None and meta.dec_kv_slots.shape[1] > 0  # a burst's later forwards write slots
    _, meta, _ = prepare_step(rc, buf, plan_of([5, 9]), 20, 4, True)
    assert meta.dec_rows is None  # a graph bucket's fixed shapes
    _, meta, _ = prepare_step(rc, buf, plan_of([5, 9]), 20, None, False)
    assert meta.dec_rows is None  # row_views off: a compiled or CUDA forward
