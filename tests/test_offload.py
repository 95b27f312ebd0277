"""cpu_offload_space: preempted requests' KV pages go to a host pool and come back instead of being recomputed;
the plan carries the copies; the pool is sized from the config. Also the scheduler's per-step costs that must
not follow the context length (block hashing, streamed outputs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cluster
from cluster.config import GIB, ContinuousBatchingConfig, host_pool_pages, resolve_config
from cluster.plan import HEADER_LEN, H, StepPlan, plan_from_parts
from driver.engine.block_manager import BlockManager, chain_hash
from driver.engine.request import Request
from driver.engine.scheduler import Scheduler
from tests.conftest import hf_greedy
from tests.workloads import NEW_TOKENS, mixed_prompts
from worker.kv_cache import KVCache, kv_bytes_per_token
from worker.kv_offload import runs
from worker.self_attention import head_dim_of


def req(rid: str, tokens, n: int = 4) -> Request:
    return Request(request_id=rid, prompt_ids=list(tokens), max_new_tokens=n)


def scheduler(num_blocks: int, page: int, host_pages: int, budget: int = 64) -> Scheduler:
    rc = resolve_config(ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=budget),
                        device_kind="cpu", max_model_len=256, kv_bytes_per_token=8, free_bytes=None,
                        flash_available=False)
    rc.num_host_blocks = host_pages
    return Scheduler(rc, BlockManager(num_blocks, page, allow_sharing=True))


def run_step(s: Scheduler) -> list[str]:
    """Schedule, then do what the engine does after a forward: count the tokens, register blocks, sample 1."""
    batch, _ = s.schedule()
    for x in batch:
        samples = x.samples
        x.req.num_computed += x.num_tokens
        s.blocks.register_full_blocks(x.req)
        if samples:
            x.req.generated.append(1)
    return [x.req.request_id for x in batch]


def two_full_requests(host_pages: int) -> tuple[Scheduler, Request, Request]:
    """Two 8-token requests filling a 4-page cache of 4-token pages, each with its first token sampled."""
    s = scheduler(4, 4, host_pages)
    a, b = req("a", range(3, 11)), req("b", range(20, 28))
    s.add(a)
    s.add(b)
    assert run_step(s) == ["a", "b"] and s.blocks.num_free == 0
    s.host.take()
    return s, a, b


def test_plan_carries_swaps_after_the_arrays():
    assert HEADER_LEN == 20 and (H.NUM_SWAP_OUT, H.NUM_SWAP_IN, H.ARGMAX_ON_SHARDS, H.GATHER_STATE,
                                 H.NUM_PAGE_COPIES, H.NUM_SCORED, H.SCORE_TOP) == (12, 13, 14, 15, 17, 18, 19)
    plan = StepPlan(step=3, argmax_on_shards=True, input_ids=np.arange(5, dtype=np.int32), q_lens=np.array([2, 3], np.int32),
                    kv_lens=np.array([4, 3], np.int32), sample=np.array([1, 1], np.int32),
                    block_tables=np.array([[1, 2], [3, 0]], np.int32),
                    swap_out=np.array([[5, 0], [6, 1]], np.int32), swap_in=np.array([[7, 9]], np.int32),
                    page_copies=np.array([[2, 4]], np.int32))
    h = plan.header()
    assert (h[H.NUM_SWAP_OUT], h[H.NUM_SWAP_IN], h[H.NUM_PAGE_COPIES], h[H.PAYLOAD_LEN]) == (2, 1, 1, 5 + 6 + 4 + 8)
    back = plan_from_parts(h, plan.payload(), b"")
    assert back.swap_out.tolist() == [[5, 0], [6, 1]] and back.swap_in.tolist() == [[7, 9]]
    assert back.page_copies.tolist() == [[2, 4]]
    assert back.block_tables.tolist() == [[1, 2], [3, 0]] and back.input_ids.tolist() == list(range(5))
    assert back.argmax_on_shards and not plan_from_parts(StepPlan().header(), None, b"").argmax_on_shards
    plain = plan_from_parts(StepPlan().header(), None, b"")
    assert plain.swap_out.shape == (0, 2) and plain.swap_in.shape == (0, 2) and plain.page_copies.shape == (0, 2)


def test_host_pool_sized_in_pages_and_capped_by_the_ram():
    notes: list[str] = []
    assert host_pool_pages(ContinuousBatchingConfig(cpu_offload_space=1.0), 1 << 20, None, notes) == 1024
    assert host_pool_pages(ContinuousBatchingConfig(cpu_offload_space=0.0), 1 << 20, None, notes) == 0
    assert host_pool_pages(ContinuousBatchingConfig(cpu_offload_space=None), 1 << 20, None, notes) == 0
    assert not notes
    capped = ContinuousBatchingConfig(cpu_offload_space=4.0, cpu_offload_space_safety_threshold=0.5)
    assert host_pool_pages(capped, 1 << 20, 2 * GIB, notes) == 1024 and "capped" in notes[0]
    rc = resolve_config(ContinuousBatchingConfig(page_size=16, cpu_offload_space=0.5), device_kind="cpu",
                        max_model_len=256, kv_bytes_per_token=4096, free_bytes=None, flash_available=False)
    assert rc.num_host_blocks == (GIB // 2) // (16 * 4096)


def test_preempted_request_swaps_out_and_comes_back_without_recompute():
    s, a, b = two_full_requests(host_pages=4)
    old_pages, old_hashes = list(b.block_ids), list(b.block_hashes)
    assert run_step(s) == ["a"]  # a needs a third page: b is preempted, its two pages go to the host
    out, into = s.host.take()
    assert out.tolist() == [[old_pages[0], 0], [old_pages[1], 1]] and into.size == 0
    assert b.num_computed == 8 and b.block_ids == [] and b.block_hashes == old_hashes and list(s.waiting) == [b]
    s.finish(a)
    assert run_step(s) == ["b"]  # b comes back: its first page is still cached, only the second is copied
    out, into = s.host.take()
    assert b.block_ids[0] == old_pages[0] and out.size == 0
    assert into.tolist() == [[1, b.block_ids[1]]]
    assert b.num_computed == 9 and b.block_hashes == old_hashes
    assert s.blocks.hash_to_block[old_hashes[1]] == b.block_ids[1]  # the prefix is findable in its new page
    assert s.offload_stats() == {"swapped_out_requests": 1, "swapped_out_pages": 2, "swapped_in_requests": 1,
                                 "swapped_in_pages": 1, "recomputed_tokens": 0}
    assert len(s.host.free) == 4 and not s.host.held


def test_a_full_pool_falls_back_to_recompute():
    s, a, b = two_full_requests(host_pages=1)  # b's two pages do not fit
    assert run_step(s) == ["a"]
    out, _ = s.host.take()
    assert out.size == 0 and b.num_computed == 0 and not s.host.holds(b)
    s.finish(a)
    run_step(s)
    assert s.offload_stats()["swapped_out_requests"] == 0
    assert s.offload_stats()["recomputed_tokens"] == 8 - 4  # its first page was still in the prefix cache


def test_weight_change_with_recompute_drops_the_host_copy():
    s, a, b = two_full_requests(host_pages=4)
    run_step(s)
    assert list(s.host.held) == [b]
    s.preempt(b)  # what a weight update with kv_policy="recompute" does to every request holding KV
    assert b.num_computed == 0 and b.block_hashes == [] and not s.host.holds(b) and list(s.waiting) == [b]


def test_kv_cache_copies_pages_out_and_back():
    cache = KVCache(2, num_blocks=6, page_size=4, kv_heads=2, head_dim=3, dtype=torch.float32,
                    device=torch.device("cpu"), num_host_blocks=3)
    pages = [k.view(7, 4, 2, 3) for k in cache.k + cache.v]
    for p in pages:
        p[1:3].normal_()
    before = [p[1:3].clone() for p in pages]
    cache.apply_swaps(np.array([[1, 0], [2, 1]]), np.zeros((0, 2), np.int64))
    for p in pages:
        p[1:3].zero_()
    cache.apply_swaps(np.zeros((0, 2), np.int64), np.array([[0, 4], [1, 5]]))
    for p, want in zip(pages, before):
        assert torch.equal(p[4:6], want)
    assert runs(np.array([[1, 0], [2, 1], [5, 2], [3, 3]])) == [(1, 0, 2), (5, 2, 1), (3, 3, 1)]


def test_block_hashing_touches_only_new_tokens(monkeypatch):
    """A decode step registers no block and never builds the request's whole token list; full blocks are
    hashed from slices, with the same hashes as before."""
    bm = BlockManager(num_blocks=64, page_size=4, allow_sharing=True)
    r = req("r", range(3, 103))
    assert bm.allocate(r, 101)
    r.num_computed = 100
    r.generated.append(7)
    want = list(r.tokens)
    monkeypatch.setattr(Request, "tokens", property(lambda self: pytest.fail("built the whole token list")))
    bm.register_full_blocks(r)
    h = b""
    for i in range(25):
        h = chain_hash(h, want[i * 4:(i + 1) * 4])
    assert r.block_hashes[-1] == h and len(r.block_hashes) == 25
    r.num_computed = 101  # a decode step: no new full block
    bm.register_full_blocks(r)
    other = req("o", want[:100] + [5, 6])
    bm.match_prefix(other)
    assert other.num_computed == 100


def test_streamed_outputs_share_one_prompt_copy():
    r = req("r", range(3, 1003))
    r.generated.append(5)
    first = r.output()
    r.generated.append(6)
    second = r.output()
    assert first.prompt_ids is second.prompt_ids and first.prompt_ids is not r.prompt_ids
    assert first.prompt_ids == r.prompt_ids and first.generated_tokens == [5] and second.generated_tokens == [5, 6]


@pytest.mark.slow
def test_small_pool_swaps_some_and_recomputes_others(make_checkpoint):
    """A pool of 6 pages: some victims fit it, others are recomputed; outputs still match transformers."""
    model_dir = make_checkpoint("llama")
    model = cluster.load(model_dir)
    c = model.config
    page_bytes = 16 * kv_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, head_dim_of(c), torch.float32)
    prompts = mixed_prompts(model.config.vocab_size)
    out = model.generate_batch(prompts, max_new_tokens=NEW_TOKENS, continuous_batching_config=ContinuousBatchingConfig(
        page_size=16, num_blocks=32, max_batch_tokens=128, cpu_offload_space=6.5 * page_bytes / GIB))
    assert [o.generated_tokens for o in out.values()] == hf_greedy(model_dir, prompts)
    stats = model.last_stats
    assert stats["num_host_blocks"] == 6
    assert stats["swapped_out_requests"] > 0 and stats["recomputed_tokens"] > 0
    assert stats["swapped_out_requests"] < stats["preemptions"]


def test_slots_a_swap_in_reads_are_not_reused_in_the_same_plan():
    from driver.engine.host_pool import HostPool

    pool = HostPool(2)
    r1, r2 = req("r1", [3]), req("r2", [4])
    assert pool.swap_out(r1, [5, 6])
    pool.take()
    pool.swap_in(r1, [1, 2])
    assert not pool.swap_out(r2, [3])  # both slots are still to be read by this plan's swap-ins
    out, into = pool.take()
    assert out.size == 0 and into.tolist() == [[0, 1], [1, 2]]
    assert pool.swap_out(r2, [3]) and pool.take()[0].tolist() == [[3, 0]]
