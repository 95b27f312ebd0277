"""Eager CPU prefill (worker/attention.py `_prefill_runs`, AttnMeta.pre_runs): each prefill sequence attended on its
own, unpadded (a causal square through SDPA's is_causal where nothing is cached before it), gives what the padded
query grid gives for the same plan: sequences with and without a cached prefix, beside decode rows, a sliding
window, sinks and a softcap, one cache read as keys and values (MLA's latent), queries in chunks, GQA; padding
tokens return zeros and stale K/V (NaN) past each sequence's keys is never read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.plan import StepPlan
from tests.test_step_inputs import rc_for
from worker.attention import ScoreTerms, paged_attention
from worker.step_inputs import StaticBuffers, prepare_step

PAGE = 16
HQ, HKV, D = 6, 2, 8
# (query tokens, cached before them): two decode rows, then prefill sequences: a whole prompt, a chunk after a
# cached prefix, a one-token prompt, a chunk after a prefix of a page and a half
SEQS = [(1, 11), (1, 30), (23, 0), (9, 40), (1, 0), (17, 24)]


def plan_of(seqs: list[tuple[int, int]]) -> StepPlan:
    q_lens = np.array([q for q, _ in seqs], np.int32)
    kv_lens = np.array([q + c for q, c in seqs], np.int32)
    width = -(-int(kv_lens.max()) // PAGE)
    tables = np.random.default_rng(2).permutation(len(seqs) * width).astype(np.int32).reshape(len(seqs), width)
    return StepPlan(input_ids=np.arange(3, 3 + int(q_lens.sum()), dtype=np.int32), q_lens=q_lens, kv_lens=kv_lens,
                    sample=np.ones(len(seqs), np.int32), block_tables=tables)


@pytest.mark.parametrize("case", ["plain", "window", "sinks", "softcap", "latent", "chunked"])
def test_unpadded_runs_equal_the_padded_grid(case):
    rc = rc_for(False)
    rc.page_size = PAGE
    if case == "chunked":
        rc.attn_chunk_elements = 1500  # a few queries a chunk
    plan = plan_of(SEQS)
    scratch_block = int(plan.block_tables.max()) + 1
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn((scratch_block + 1) * PAGE, HKV, D, generator=gen)
    v_cache = k_cache if case == "latent" else torch.randn((scratch_block + 1) * PAGE, HKV, D, generator=gen)
    for i, (q, c) in enumerate(SEQS):  # stale K/V past each sequence's keys on its last page: never read
        n = q + c
        last = int(plan.block_tables[i, (n - 1) // PAGE]) * PAGE
        k_cache[last + (n - 1) % PAGE + 1:last + PAGE] = float("nan")
        if v_cache is not k_cache:
            v_cache[last + (n - 1) % PAGE + 1:last + PAGE] = float("nan")
    terms = {"sinks": ScoreTerms(sinks=torch.randn(HQ, generator=gen)),
             "softcap": ScoreTerms(softcap=2.0)}.get(case, ScoreTerms())
    window = 5 if case == "window" else None
    out, metas = {}, {}
    for rows in (False, True):
        _, meta, _ = prepare_step(rc, StaticBuffers(rc, torch.device("cpu")), plan, scratch_block, None, rows)
        q = torch.randn(meta.positions.shape[0], HQ, D, generator=torch.Generator().manual_seed(1))
        out[rows], metas[rows] = paged_attention(q, k_cache, v_cache, meta, window, D ** -0.5, terms=terms), meta
    assert metas[False].pre_runs is None
    assert metas[True].pre_runs == [(0, 23, 0), (23, 9, 40), (32, 1, 0), (33, 17, 24)]
    real = metas[True].slot_mapping != metas[True].scratch_slot  # padding tokens write the scratch block
    assert out[True].shape == out[False].shape and int(real.sum()) == sum(q for q, _ in SEQS)
    assert not out[True][real].isnan().any()
    torch.testing.assert_close(out[True][real], out[False][real], rtol=1e-5, atol=1e-5)
    assert not out[True][~real].any()  # padding rows and padding queries: zeros, never read


def test_a_compiled_or_cuda_forward_keeps_the_padded_grid():
    rc = rc_for(False)
    rc.page_size = PAGE
    _, meta, _ = prepare_step(rc, StaticBuffers(rc, torch.device("cpu")), plan_of(SEQS), 99, None, False)
    assert meta.pre_runs is None and meta.pre_q_pos.shape[0] == 4  # row_views off: the grid, fixed shapes
