"""Decode CUDA graphs, driven on the CPU through the stand-in factory: which bucket a step takes, static
inputs that never move, padding rows on the scratch block, replay equal to eager, warm-up capturing every
bucket, and the address check a weight update relies on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cluster
from cluster.config import ContinuousBatchingConfig
from cluster.plan import StepPlan
from worker.graphs import EagerStandIn, GraphInputMoved, bucket_for, decode_buckets, decode_widths
from worker.loader import apply, stage_checkpoint
from worker.self_attention import KVHeads, head_dim_of
from worker.runner import ModelRunner, static_inputs

CFG = {"page_size": 16, "num_blocks": 64, "max_requests_per_batch": 8, "max_blocks_per_request": 8}


def graph_runner(model, factory=None, **cfg):
    """A runner whose decode graphs are captured by the CPU stand-in, and an eager twin (own caches)."""
    eager, rc, _ = model.build_runner(ContinuousBatchingConfig(**{**CFG, **cfg}))
    kv = KVHeads(model.config, model.model.shard).kv_local
    graphs = ModelRunner(model.model, rc, kv, head_dim_of(model.config), model.dtype, model.device,
                         graph_factory=factory or EagerStandIn())
    return graphs, eager


def prefill_plan(lens: list[int], first_block: int = 0) -> StepPlan:
    """Whole prompts of the given lengths, each on its own run of blocks."""
    tables = np.zeros((len(lens), 8), np.int32)
    for i in range(len(lens)):
        tables[i] = np.arange(first_block + 8 * i, first_block + 8 * i + 8)
    ids = np.concatenate([np.arange(3 + i, 3 + i + n) % 200 for i, n in enumerate(lens)]).astype(np.int32)
    return StepPlan(input_ids=ids, q_lens=np.array(lens, np.int32), kv_lens=np.array(lens, np.int32),
                    sample=np.ones(len(lens), np.int32), block_tables=tables)


def decode_plan(tokens: list[int], kv_lens: list[int], first_block: int = 0, sample=None, width: int = 8) -> StepPlan:
    n = len(tokens)
    tables = np.stack([np.arange(first_block + width * i, first_block + width * (i + 1))
                       for i in range(n)]).astype(np.int32)
    return StepPlan(input_ids=np.array(tokens, np.int32), q_lens=np.ones(n, np.int32),
                    kv_lens=np.array(kv_lens, np.int32),
                    sample=np.ones(n, np.int32) if sample is None else np.array(sample, np.int32),
                    block_tables=tables)


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return cluster.load(make_checkpoint("qwen3"))


def test_bucket_choice():
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(12) == [1, 2, 4, 8, 16]  # a full batch of 12 pads to 16
    assert decode_buckets(1) == [1]
    buckets = decode_buckets(8)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert bucket_for(9, buckets) is None and bucket_for(0, buckets) is None


def test_warmup_captures_every_bucket(model):
    factory = EagerStandIn()
    runner, _ = graph_runner(model, factory)
    assert runner.graph_stats["captured_buckets"] == []
    runner.execute(runner.warmup_plan())  # what the manager's warm-up runs on every rank
    assert runner.graph_stats["captured_buckets"] == [1, 2, 4, 8]
    assert len(factory.recorded) == 4  # one capture a bucket
    assert runner.graph_stats["replays"] == 1 and runner.graph_stats["eager_steps"] == 0


def test_replay_matches_eager_and_steps_pick_their_path(model):
    runner, eager = graph_runner(model)
    lens = [5, 19, 33]
    for r in (runner, eager):
        r.execute(prefill_plan(lens))
    assert runner.graph_stats["eager_steps"] == 1  # a prefill step is never replayed
    tokens = [7, 8, 9]
    for step in range(4):
        kv = [n + step + 1 for n in lens]
        plan = decode_plan(tokens, kv)
        got, want = runner.execute(plan), eager.execute(plan)
        assert got.shape == want.shape == (3, model.config.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        tokens = want.argmax(-1).tolist()
    assert runner.graph_stats["replays"] == 4
    # a decode group whose rows do not all sample: only the sampled rows come back, in order
    plan = decode_plan(tokens, [n + 5 for n in lens], sample=[1, 0, 1])
    got, want = runner.execute(plan), eager.execute(plan)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a mixed step (decodes and a prefill chunk) runs eagerly
    mixed = StepPlan(input_ids=np.arange(5, 15, dtype=np.int32), q_lens=np.array([1, 9], np.int32),
                     kv_lens=np.array([lens[0] + 6, 9], np.int32), sample=np.array([1, 1], np.int32),
                     block_tables=np.stack([np.arange(0, 8), np.arange(24, 32)]).astype(np.int32))
    before = dict(runner.graph_stats)
    torch.testing.assert_close(runner.execute(mixed), eager.execute(mixed), rtol=1e-5, atol=1e-5)
    assert runner.graph_stats["eager_steps"] == before["eager_steps"] + 1
    assert runner.graph_stats["replays"] == before["replays"]


def test_static_inputs_never_move(model):
    factory = EagerStandIn()
    runner, _ = graph_runner(model, factory)
    runner.execute(runner.warmup_plan())
    captured = dict(zip([8, 4, 2, 1], factory.recorded))  # captured largest first
    for n, kv in [(1, 5), (3, 40), (4, 17), (7, 100), (3, 2), (8, 64)]:
        plan = decode_plan(list(range(3, 3 + n)), [kv] * n)
        runner.execute(plan)
        bucket = bucket_for(n, decode_buckets(8))
        ids, meta, _ = runner.prepare(plan, bucket=bucket)
        now = {k: t.data_ptr() for k, t in static_inputs(ids, meta).items()}
        assert now == captured[bucket]
        assert meta.dec_kv_slots.shape == (bucket, runner.rc.max_kv_padded)  # fixed width whatever the contexts
    assert runner.graph_stats["replays"] == 7
    # a static input somewhere else is refused rather than replayed on stale memory
    ids, meta, _ = runner.prepare(decode_plan([3], [4]), bucket=1)
    moved = static_inputs(ids, meta) | {"input_ids": ids.clone()}
    with pytest.raises(GraphInputMoved, match="input_ids"):
        runner.graphs.replay((1, runner.rc.max_kv_padded), moved)


def test_gathering_graphs_are_bucketed_by_kv_width(model):
    assert decode_widths(True, 2048) == [0]  # the paged kernels read block tables: the width does not matter
    assert decode_widths(False, 2048) == [256, 512, 1024, 2048] and decode_widths(False, 128) == [128]
    factory = EagerStandIn()
    runner, eager = graph_runner(model, factory, num_blocks=160, max_blocks_per_request=40)  # 640-token contexts
    runner.execute(runner.warmup_plan())
    assert runner.graph_stats["kv_widths"] == [256, 512, 640] and runner.graph_stats["captures"] == 4 * 3
    lens = [30, 300]
    for r in (runner, eager):
        r.execute(StepPlan(
            input_ids=np.arange(3, 3 + sum(lens), dtype=np.int32) % 200, q_lens=np.array(lens, np.int32),
            kv_lens=np.array(lens, np.int32), sample=np.ones(2, np.int32),
            block_tables=np.stack([np.arange(0, 40), np.arange(40, 80)]).astype(np.int32)))
    for kv, width in [([31, 31], 256), ([31, 301], 512)]:  # the narrowest width that holds the longest row
        plan = decode_plan([7, 8], kv, width=40)
        replays = runner.graph_stats["replays"]
        torch.testing.assert_close(runner.execute(plan), eager.execute(plan), rtol=1e-5, atol=1e-5)
        assert runner.graph_stats["replays"] == replays + 1
        assert runner.graphs.key_for(2, max(kv)) == (2, width)
        assert runner.prepare(plan, 2, width=width)[1].dec_kv_slots.shape == (2, width)


def test_padding_rows_point_at_the_scratch_block(model):
    runner, _ = graph_runner(model)
    scratch_slot, page = runner.cache.scratch_slot, runner.rc.page_size
    ids, meta, n = runner.prepare(decode_plan([11, 12, 13], [37, 2, 20]), bucket=4)
    assert n == 3 and ids.shape == (4,)
    slots = meta.dec_kv_slots.cpu().numpy()
    assert (slots[3] == scratch_slot).all()  # the padding row reads only the scratch block
    assert meta.slot_mapping[3].item() == scratch_slot  # and writes only there
    assert ids[3].item() == 0 and meta.positions[3].item() == 0 and meta.dec_q_pos[3].item() == 0
    for row, kv in enumerate([37, 2, 20]):  # real rows: their slots, then the scratch slot past their end
        assert (slots[row, :kv] == [(8 * row + j // page) * page + j % page for j in range(kv)]).all()
        assert (slots[row, kv:] == scratch_slot).all()
    assert meta.logits_idx.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="bucket"):
        runner.prepare(decode_plan([1, 2, 3], [4, 4, 4]), bucket=2)


def test_address_check_after_weight_update(make_checkpoint):
    model = cluster.load(make_checkpoint("qwen3"))
    runner, eager = graph_runner(model)
    assert runner.check_graph_addresses() == []  # nothing captured yet, nothing to check
    runner.execute(runner.warmup_plan())
    assert runner.check_graph_addresses() == []
    # the real update path copies into the existing storage: the graphs still read the right memory
    apply(stage_checkpoint(model.model, make_checkpoint("qwen3", seed=1)))
    assert runner.check_graph_addresses() == []
    for r in (runner, eager):
        r.execute(prefill_plan([6, 9]))
    plan = decode_plan([4, 5], [7, 10])
    torch.testing.assert_close(runner.execute(plan), eager.execute(plan), rtol=1e-5, atol=1e-5)
    # rebinding a parameter's storage is what the check exists to catch
    name, param = next((n, p) for n, p in model.model.named_parameters() if "down_proj" in n)
    param.data = param.data.clone()
    assert runner.check_graph_addresses() == [name]
    runner.cache.k[0].data = runner.cache.k[0].data.clone()
    assert runner.check_graph_addresses() == sorted([name, "kv_cache.k.0"])
