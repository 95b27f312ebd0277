"""The paged SDPA fallback's workspace is bounded: a batch of long contexts gathers its keys in chunks (or a
sequence at a time) under the configured element budget (measured with the profiler's allocator events), never the whole
batch's contexts at once, with outputs unchanged; and flash-attn's path reached on the CPU through a stand-in with
the real functions' signatures and documented semantics (its softcap, its log-sum-exp, which the path folds the
sinks in through), against the paged SDPA path, and its varlen metadata built on the host."""

from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import cluster
from cluster.config import ContinuousBatchingConfig
from cluster.plan import StepPlan
from worker.attention import paged_attention

PAGE, BLOCKS_EACH, CONTEXT, CHUNK = 16, 64, 1000, 32
BUDGET = 1 << 19  # elements a chunk may use


def peak_bytes(fn) -> tuple[int, object]:
    """Peak of CPU bytes allocated and not yet freed while fn runs, from the allocator's events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, out


def long_context_plan(n_decode: int, n_prefill: int) -> StepPlan:
    """Decodes at CONTEXT tokens, then prefill chunks of CHUNK tokens ending at CONTEXT: every sequence
    reads about CONTEXT keys."""
    n = n_decode + n_prefill
    q_lens = np.array([1] * n_decode + [CHUNK] * n_prefill, np.int32)
    tables = np.arange(n * BLOCKS_EACH, dtype=np.int32).reshape(n, BLOCKS_EACH)
    return StepPlan(input_ids=np.full(int(q_lens.sum()), 5, np.int32), q_lens=q_lens,
                    kv_lens=np.full(n, CONTEXT, np.int32), sample=np.ones(n, np.int32), block_tables=tables)


@pytest.fixture(scope="module")
def setup(make_checkpoint):
    model = cluster.load(make_checkpoint("qwen3"))
    runner, _, _ = model.build_runner(ContinuousBatchingConfig(
        page_size=PAGE, num_blocks=16 * BLOCKS_EACH, max_requests_per_batch=16, max_blocks_per_request=BLOCKS_EACH))
    gen = torch.Generator().manual_seed(0)
    for t in runner.cache.k + runner.cache.v:
        t.copy_(torch.randn(t.shape, generator=gen))
    return model, runner


def attention_of(runner, plan, budget, grid=False):
    """The first layer's attention over `plan`; `grid`: prefill through the padded query grid (`_prefill_sdpa`,
    a compiled forward's) instead of sequence by sequence (`_prefill_runs`, the eager CPU forward's)."""
    runner.rc.attn_chunk_elements = budget
    ids, meta, _ = runner.prepare(plan)
    if grid:
        meta.pre_runs = None
    attn = runner.model.layers[0].self_attn
    q = torch.randn(ids.shape[0], attn.hq, attn.d, generator=torch.Generator().manual_seed(1))
    k, v = runner.cache.k[0], runner.cache.v[0]
    return lambda: paged_attention(q, k, v, meta, attn.window, attn.scale), attn


def test_long_context_attention_stays_under_the_bound(setup):
    model, runner = setup
    plan = long_context_plan(8, 8)
    whole, attn = attention_of(runner, plan, 1 << 40, grid=True)  # one chunk: the whole batch gathered at once
    dense_peak, reference = peak_bytes(whole)
    # the keys and values of the 8 prefill sequences alone, gathered densely
    gathered = 2 * 8 * 1024 * attn.hkv * attn.d * 4
    assert dense_peak > gathered  # the measurement sees the gather

    from worker.attention import attention_workspace_bytes

    for grid in (True, False):  # in chunks of the grid; a sequence at a time
        peak, out = peak_bytes(attention_of(runner, plan, BUDGET, grid)[0])
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
        assert peak < gathered / 3, f"peak {peak} bytes for a batch whose dense gather is {gathered}"
        assert peak <= attention_workspace_bytes(runner.rc, attn.hq, attn.hkv, attn.d, model.dtype)


def test_bound_holds_whatever_the_batch(setup):
    from worker.attention import attention_workspace_bytes

    model, runner = setup
    runner.rc.attn_chunk_elements = BUDGET
    attn = runner.model.layers[0].self_attn
    bound = attention_workspace_bytes(runner.rc, attn.hq, attn.hkv, attn.d, model.dtype)
    peaks = [peak_bytes(attention_of(runner, long_context_plan(d, p), BUDGET, grid)[0])[0]
             for d, p in [(16, 0), (0, 16), (1, 1), (4, 12)] for grid in (True, False)]
    assert max(peaks) <= bound
    # the bound grows with the longest context the config allows, not with the batch
    runner.rc.attn_chunk_elements = 1
    assert attention_workspace_bytes(runner.rc, attn.hq, attn.hkv, attn.d, model.dtype) < bound


def test_model_outputs_unchanged_by_chunking(setup):
    _, runner = setup
    plan = long_context_plan(4, 4)
    logits = {}
    for budget in (1 << 40, BUDGET, 1):
        runner.rc.attn_chunk_elements = budget
        logits[budget] = runner.execute(plan)
    torch.testing.assert_close(logits[BUDGET], logits[1 << 40], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], logits[1 << 40], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the flash-attn path, reached on the CPU
def _reference_attention(q, k_pages, v_pages, table, q_len, k_len, scale, causal, window_size, softcap):
    """flash-attn's documented semantics for one sequence: causal mask aligned bottom-right, window
    (left, right) around the aligned diagonal, GQA by head groups, keys read through the block table, scores
    capped when softcap > 0. Returns (out [Q, Hq, D], the log-sum-exp of each row's scores [Hq, Q] float32)."""
    hq, d = q.shape[1], q.shape[2]
    k = k_pages[table.long()].reshape(-1, k_pages.shape[2], d)[:k_len]
    v = v_pages[table.long()].reshape(-1, v_pages.shape[2], d)[:k_len]
    g = hq // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    i = torch.arange(q_len)[:, None] + (k_len - q_len)
    j = torch.arange(k_len)[None, :]
    left, right = window_size
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype), scores.logsumexp(-1)


def fake_flash_attn():
    """A stand-in `flash_attn` module with the real functions' signatures and argument checks."""
    import types

    mod = types.ModuleType("flash_attn")
    calls = {"varlen": 0, "kvcache": 0}

    def check_paged(k, v, block_table):
        assert k.dim() == 4 and k.shape == v.shape and k.shape[1] % 256 == 0, "paged KV needs page % 256 == 0"
        assert block_table.dtype == torch.int32 and block_table.is_contiguous()

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        check_paged(k, v, block_table)
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        assert len(cq) == len(ck) == block_table.shape[0] + 1 and cq[-1] == q.shape[0]
        assert max_seqlen_q == max(b - a for a, b in itertools.pairwise(cq))
        assert max_seqlen_k == max(b - a for a, b in itertools.pairwise(ck))
        calls["varlen"] += 1
        outs, lses = zip(*[_reference_attention(q[cq[s]:cq[s + 1]], k, v, block_table[s], cq[s + 1] - cq[s],
                                                ck[s + 1] - ck[s], softmax_scale, causal, window_size, softcap)
                           for s in range(len(cq) - 1)])
        out = torch.cat(outs)
        return (out, torch.cat(lses, dim=1), None) if return_attn_probs else out  # lse: [Hq, total_q]

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False):
        check_paged(k_cache, v_cache, block_table)
        assert cache_seqlens.dtype == torch.int32 and q.dim() == 4 and q.shape[1] == 1
        calls["kvcache"] += 1
        lens = cache_seqlens.tolist()
        outs, lses = zip(*[_reference_attention(q[s], k_cache, v_cache, block_table[s], 1, lens[s], softmax_scale,
                                                causal, window_size, softcap) for s in range(q.shape[0])])
        out = torch.stack(outs)
        return (out, torch.stack(lses)) if return_softmax_lse else out  # lse: [B, Hq, 1]

    mod.flash_attn_varlen_func = flash_attn_varlen_func
    mod.flash_attn_with_kvcache = flash_attn_with_kvcache
    mod.calls = calls
    return mod


def flash_plans() -> list[StepPlan]:
    """Whole prompts; then a mixed step (three decodes and a new prompt); then four decodes. Page 256."""
    t = lambda *rows: np.array(rows, np.int32)
    tables = t([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15])
    lens = [300, 40, 520]
    ids = np.concatenate([np.arange(n) % 97 + 3 for n in lens]).astype(np.int32)
    prefill = StepPlan(input_ids=ids, q_lens=t(*lens), kv_lens=t(*lens), sample=t(1, 1, 1), block_tables=tables[:3])
    mixed = StepPlan(input_ids=np.concatenate([[7, 8, 9], np.arange(100) % 50 + 4]).astype(np.int32),
                     q_lens=t(1, 1, 1, 100), kv_lens=t(301, 41, 521, 100), sample=t(1, 1, 1, 1), block_tables=tables)
    decode = StepPlan(input_ids=t(10, 11, 12, 13), q_lens=t(1, 1, 1, 1), kv_lens=t(302, 42, 522, 101),
                      sample=t(1, 1, 1, 1), block_tables=tables)
    return [prefill, mixed, decode]


# gpt-oss: sinks (folded in through flash-attn's log-sum-exp); Gemma 2: its score softcap (flash-attn's own argument)
@pytest.mark.parametrize("arch,overrides", [("qwen3", {}), ("mistral", {"sliding_window": 64}), ("gpt_oss", {}),
                                            ("gemma2", {})])
def test_flash_path_matches_sdpa(make_checkpoint, monkeypatch, arch, overrides):
    model = cluster.load(make_checkpoint(arch, **overrides))
    cfg = ContinuousBatchingConfig(page_size=256, num_blocks=16, max_batch_tokens=1024)
    sdpa, _, _ = model.build_runner(cfg)
    flash, rc, _ = model.build_runner(cfg)
    rc.attention = "flash_attn"  # what resolve_config decides on CUDA for float16/bfloat16
    fake = fake_flash_attn()  # installed after transformers' imports, which probe for the real package
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    for plan in flash_plans():
        torch.testing.assert_close(flash.execute(plan), sdpa.execute(plan), rtol=1e-4, atol=1e-4)
    layers = model.config.num_hidden_layers
    assert fake.calls == {"varlen": 2 * layers, "kvcache": 2 * layers}


def test_flash_metadata_built_on_the_host(make_checkpoint):
    model = cluster.load(make_checkpoint("qwen3"))
    runner, rc, _ = model.build_runner(ContinuousBatchingConfig(page_size=256, num_blocks=16, max_batch_tokens=1024))
    rc.attention = "flash_attn"
    _, meta, _ = runner.prepare(flash_plans()[1])
    scratch = runner.cache.scratch_block
    pre = meta.pre_flash
    assert pre.cu_seqlens_q.tolist() == [0, 100] and pre.cu_seqlens_k.tolist() == [0, 100]
    assert (pre.max_seqlen_q, pre.max_seqlen_k, pre.num_tokens) == (100, 100, 100)
    assert pre.block_table.tolist() == [[12, 13, 14, 15]] and pre.block_table.dtype == torch.int32
    # the decode group: 3 sequences padded to 4 rows; the padding row reads one token of the scratch block
    assert meta.dec_block_table.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [scratch] * 4]
    assert meta.dec_kv_lens.tolist() == [301, 41, 521, 1]
    # a prefill group of several sequences, with tables narrower than max_blocks_per_request
    _, meta, _ = runner.prepare(flash_plans()[0])
    pre = meta.pre_flash
    assert pre.cu_seqlens_q.tolist() == [0, 300, 340, 860] and pre.cu_seqlens_k.tolist() == [0, 300, 340, 860]
    assert (pre.max_seqlen_q, pre.max_seqlen_k, pre.num_tokens) == (520, 520, 860)
    assert meta.dec_block_table is None
    # the tables' storage is the flat static buffer's, whatever the step
    flat = runner.buffers.flat.untyped_storage().data_ptr()
    assert pre.block_table.untyped_storage().data_ptr() == pre.cu_seqlens_q.untyped_storage().data_ptr() == flat
    # no [B, L] slot lists or padded query grids under flash-attn: the kernels read the block tables
    assert meta.dec_kv_slots.numel() == meta.pre_kv_slots.numel() == meta.pre_q_gather.numel() == 0
