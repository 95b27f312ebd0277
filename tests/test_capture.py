"""The forward is capture-safe: it compiles with fullgraph=True (no graph breaks, no host syncs), and the
runner's static input buffers keep their storage across steps of different shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cluster
import worker.attention
from cluster.config import ContinuousBatchingConfig, round_up
from cluster.plan import StepPlan

# the SDPA fallback's chunk budget of the mixed_in_chunks case: on the tiny qwen3 checkpoint the mixed plan's two
# decodes take a chunk each and its 20-token prefill (32 padded queries) six, so every layer's attention loops
# over several chunks of both kinds; a smaller budget (one query a chunk: 34 chunks a layer) only unrolls a
# longer graph to trace, with nothing more to check
CHUNKED_BUDGET = 26 * 1024


def decode_plan(n: int, kv_len: int, page: int) -> StepPlan:
    blocks = -(-kv_len // page)
    tables = np.arange(n * blocks, dtype=np.int32).reshape(n, blocks)
    return StepPlan(input_ids=np.arange(3, 3 + n, dtype=np.int32), q_lens=np.ones(n, np.int32),
                    kv_lens=np.full(n, kv_len, np.int32), sample=np.ones(n, np.int32), block_tables=tables)


def mixed_plan(page: int) -> StepPlan:
    # two decodes then one 20-token prefill chunk
    return StepPlan(input_ids=np.arange(5, 27, dtype=np.int32), q_lens=np.array([1, 1, 20], np.int32),
                    kv_lens=np.array([9, 40, 20], np.int32), sample=np.array([1, 1, 1], np.int32),
                    block_tables=np.array([[0, 1, 2], [3, 4, 5], [6, 7, 8]], np.int32))


@pytest.fixture(scope="module")
def runner(make_checkpoint):
    model = cluster.load(make_checkpoint("qwen3"))
    r, _, _ = model.build_runner(ContinuousBatchingConfig(page_size=16, num_blocks=64))
    return r


def recording(calls: list[tuple]):
    """worker.attention.chunk_shape, appending each call's (arguments, result) to `calls`."""
    shape = worker.attention.chunk_shape

    def chunk_shape(*args):
        calls.append((args, shape(*args)))
        return calls[-1][1]

    return chunk_shape


def chunk_counts(calls: list[tuple]) -> list[int]:
    """How many chunks each recorded chunk_shape((b, nq, ...), (rb, qc)) call splits its attention into."""
    return [-(-args[0] // rb) * -(-args[1] // qc) for args, (rb, qc) in calls]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["decode", "mixed", "decode_bucket", "mixed_in_chunks"])
def test_forward_compiles_with_fullgraph(runner, kind, monkeypatch):
    plan = decode_plan(4, 37, 16) if kind.startswith("decode") else mixed_plan(16)
    # the graph bucket's layout (full KV width) and the SDPA fallback split into several chunks must compile too
    runner.rc.attn_chunk_elements = CHUNKED_BUDGET if kind == "mixed_in_chunks" else 1 << 22
    # laid out as for a compiled forward: no per-row key runs, no per-sequence prefill (`ModelRunner.row_views`)
    monkeypatch.setattr(runner, "row_views", False)
    ids, meta, n = runner.prepare(plan, bucket=4 if kind == "decode_bucket" else None)
    assert meta.dec_units is None and meta.pre_runs is None
    calls = []
    monkeypatch.setattr(worker.attention, "chunk_shape", recording(calls))  # in the eager run only
    with torch.inference_mode():
        eager = runner.model(ids, meta, runner.cache.k, runner.cache.v)
        monkeypatch.undo()
        torch._dynamo.reset()
        compiled = torch.compile(runner.model.forward, fullgraph=True, backend="aot_eager")
        out = compiled(ids, meta, runner.cache.k, runner.cache.v)
    assert out.shape == eager.shape and out.shape[0] >= n
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    runner.rc.attn_chunk_elements = 1 << 22
    if kind == "mixed_in_chunks":  # every layer's decode and prefill attention went through several chunks
        counts = chunk_counts(calls)
        assert counts and min(counts) >= 2 and max(counts) >= 3, counts


def test_static_buffers_keep_storage(runner):
    flat = runner.buffers.flat
    before = {k: (b.data_ptr(), b.numel()) for k, b in runner.buffers.buffers.items()}
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    shapes = set()
    for plan in [decode_plan(1, 5, 16), decode_plan(3, 70, 16), mixed_plan(16), decode_plan(8, 33, 16)]:
        ids, meta, _ = runner.prepare(plan)
        runner.execute(plan)
        # every input of the forward is a view into the one flat static buffer
        for t in [ids, meta.dec_kv_slots, meta.slot_mapping, meta.positions, meta.pre_q_gather, meta.logits_idx]:
            assert t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            assert t.numel() == 0 or lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi
        shapes.add((tuple(ids.shape), tuple(meta.dec_kv_slots.shape)))
    after = {k: (b.data_ptr(), b.numel()) for k, b in runner.buffers.buffers.items()}
    assert before == after
    assert len(shapes) == 4


def test_shapes_are_padded_to_buckets(runner, monkeypatch):
    assert runner.row_views  # the eager CPU forward runs the step's own row counts
    ids, meta, n = runner.prepare(decode_plan(3, 70, 16))
    assert ids.shape[0] == 3 and meta.logits_idx.shape[0] == 3
    monkeypatch.setattr(runner, "row_views", False)  # laid out as for a compiled forward
    ids, meta, n = runner.prepare(decode_plan(3, 70, 16))
    assert ids.shape[0] == 4  # decode batches pad to a power of two
    assert meta.dec_kv_slots.shape[1] % runner.rc.kv_padding == 0
    ids, meta, n = runner.prepare(mixed_plan(16))
    q = runner.rc.q_padding  # 2 decodes + 20 prefill tokens padded to a multiple of q_padding
    assert ids.shape[0] == 2 + round_up(20, q)
    assert n == 3 and meta.logits_idx.shape[0] == 4
