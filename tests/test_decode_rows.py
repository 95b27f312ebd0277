"""Eager CPU decode (worker/attention.py `_decode_units`, AttnMeta.dec_units): the rows' keys gathered by runs of
slots give what the slot-by-slot gather gives for the same plan, with rows of one page and of several, a sliding
window and GQA, and stale K/V (NaN) past a row's length in its last run changes nothing; a step laid
out for a burst, a graph bucket or a compiled forward keeps the key-slot lists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.plan import StepPlan
from tests.test_step_inputs import rc_for
from worker.attention import paged_attention
from worker.step_inputs import StaticBuffers, prepare_step, unit_lists

PAGE = 16
HQ, HKV, D = 6, 2, 8


def plan_of(lens: list[int], burst: int = 1) -> StepPlan:
    n, width = len(lens), 4
    tables = np.random.default_rng(1).permutation(n * width).astype(np.int32).reshape(n, width)
    return StepPlan(input_ids=np.arange(3, 3 + n, dtype=np.int32), q_lens=np.ones(n, np.int32),
                    kv_lens=np.array(lens, np.int32), sample=np.ones(n, np.int32), block_tables=tables, burst=burst)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("page", [PAGE, 4, 48])  # a run of 16, of 4 (the whole page), of 16 (a third of a page)
def test_runs_of_slots_equal_the_slot_gather(window, page):
    rc = rc_for(False)
    rc.page_size = page
    lens = [1, 7, 16, 17, 40]  # one key, inside a page or a run, a full run, one past it, several pages
    plan = plan_of(lens)
    plan.block_tables = plan.block_tables.repeat(4, axis=1) * 4 + np.arange(4 * plan.block_tables.shape[1]) % 4 \
        if page == 4 else plan.block_tables  # 4-token pages: 16 a row, still scattered
    scratch_block = int(plan.block_tables.max()) + 1
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn((scratch_block + 1) * page, HKV, D, generator=gen)
    v_cache = torch.randn((scratch_block + 1) * page, HKV, D, generator=gen)
    for i, n in enumerate(lens):  # stale K/V past each row's length on its last page: never read
        last = int(plan.block_tables[i, (n - 1) // page]) * page
        k_cache[last + (n - 1) % page + 1:last + page] = float("nan")
        v_cache[last + (n - 1) % page + 1:last + page] = float("nan")
    q = torch.randn(8, HQ, D, generator=gen)  # 5 rows, padded to 8 for the slot gather
    out = {}
    for rows in (False, True):
        _, meta, _ = prepare_step(rc, StaticBuffers(rc, torch.device("cpu")), plan, scratch_block, None, rows)
        assert (meta.dec_units is not None) == rows
        if rows:
            assert meta.dec_kv_slots.shape == (5, 0) and meta.unit == (4 if page == 4 else 16)  # rows unpadded
            assert meta.dec_units.shape == (5, -(-max(lens) // meta.unit))
        out[rows] = paged_attention(q[:meta.dec_kv_slots.shape[0]], k_cache, v_cache, meta, window, D ** -0.5)
    assert out[True].shape == (5, HQ, D) and out[False].shape == (8, HQ, D)
    assert not out[True].isnan().any()
    torch.testing.assert_close(out[True], out[False][:5], rtol=1e-5, atol=1e-6)


def test_unit_lists():
    tables = np.array([[3, 7, 1], [5, 0, 2]])
    units, tail, at = unit_lists(tables, np.array([20, 9]), 8, 4, 9)
    # row 0: pages 3, 7 and half of 1, in runs of 4 slots; row 1: page 5, one run of page 0, then the scratch's
    assert units.tolist() == [[6, 7, 14, 15, 2], [10, 11, 0, 18, 18]]
    assert tail.tolist() == [29, 30, 31] and at == [0, 0, 3]  # row 1's positions 9-11 of 20, in its run of page 0


def test_bursts_buckets_and_compiled_forwards_keep_key_slot_lists():
    rc = rc_for(False)
    rc.page_size = PAGE
    buf = StaticBuffers(rc, torch.device("cpu"))
    _, meta, _ = prepare_step(rc, buf, plan_of([5, 9], burst=3), 20, None, True)
    assert meta.dec_units is None and meta.dec_kv_slots.shape[1] > 0  # a burst's later forwards write slots
    _, meta, _ = prepare_step(rc, buf, plan_of([5, 9]), 20, 4, True)
    assert meta.dec_units is None  # a graph bucket's fixed shapes
    _, meta, _ = prepare_step(rc, buf, plan_of([5, 9]), 20, None, False)
    assert meta.dec_units is None  # row_views off: a compiled or CUDA forward


def test_a_large_batch_takes_smaller_chunks_with_the_same_outputs(monkeypatch):
    import worker.attention as attention

    rc = rc_for(False)
    rc.page_size = PAGE
    lens = [1 + (7 * i) % 40 for i in range(attention.DECODE_SPLIT_ROWS)]
    plan = plan_of(lens)
    scratch_block = int(plan.block_tables.max()) + 1
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn((scratch_block + 1) * PAGE, HKV, D, generator=gen)
    v_cache = torch.randn((scratch_block + 1) * PAGE, HKV, D, generator=gen)
    q = torch.randn(len(lens), HQ, D, generator=gen)
    chunks = []
    shape = attention.chunk_shape
    monkeypatch.setattr(attention, "chunk_shape", lambda *a: chunks.append(shape(*a)) or chunks[-1])
    monkeypatch.setattr(attention, "DECODE_CHUNK_ELEMENTS", 20_000)  # a few rows a chunk at these sizes
    out = {}
    for rows in (False, True):
        _, meta, _ = prepare_step(rc, StaticBuffers(rc, torch.device("cpu")), plan, scratch_block, None, rows)
        out[rows] = paged_attention(q, k_cache, v_cache, meta, None, D ** -0.5)
    rb = chunks[-1][0]
    assert 1 < rb < len(lens)  # the large batch went in several chunks, each of several rows
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-6)
