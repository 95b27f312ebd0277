"""Block bookkeeping: reference counts, prefix sharing by process-independent hashes, and the schedulers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.config import ContinuousBatchingConfig, resolve_config
from driver.engine.block_manager import BlockManager, chain_hash
from driver.engine.host_pool import HostPool
from driver.engine.request import Request
from driver.engine.scheduler import Scheduler


def req(rid, tokens, n=4):
    return Request(request_id=rid, prompt_ids=list(tokens), max_new_tokens=n)


@pytest.mark.slow
def test_chain_hash_is_identical_in_another_process():
    here = chain_hash(b"", list(range(16))).hex()
    code = "from driver.engine.block_manager import chain_hash; print(chain_hash(b'', list(range(16))).hex())"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=sys.path[0]).stdout.strip()
    assert here == there


def test_prefix_blocks_are_shared_and_refcounted():
    bm = BlockManager(num_blocks=8, page_size=4, allow_sharing=True)
    a = req("a", range(10))
    assert bm.allocate(a, 10)
    a.num_computed = 10
    bm.register_full_blocks(a)  # two full blocks hashed
    b = req("b", list(range(8)) + [99, 98, 97])
    bm.match_prefix(b)
    assert b.block_ids == a.block_ids[:2] and b.num_computed == 8
    assert bm.ref[a.block_ids[0]] == 2
    bm.release(a)
    assert bm.ref[b.block_ids[0]] == 1
    bm.release(b)
    assert bm.num_free == 8
    # released blocks keep their hash: a third request still hits
    c = req("c", list(range(8)) + [1])
    bm.match_prefix(c)
    assert c.num_computed == 8 and bm.prefix_hit_blocks == 4


def test_whole_prompt_hit_still_leaves_a_token_to_compute():
    bm = BlockManager(num_blocks=8, page_size=4, allow_sharing=True)
    a = req("a", range(8))
    bm.allocate(a, 8)
    a.num_computed = 8
    bm.register_full_blocks(a)
    b = req("b", range(8))
    bm.match_prefix(b)
    assert b.num_computed == 4  # the last block is recomputed so its last token yields logits


def make_scheduler(num_blocks, page, kind="fifo", budget=16):
    rc = resolve_config(ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=budget,
                                                 scheduler_type=kind),
                        device_kind="cpu", max_model_len=256, kv_bytes_per_token=1, free_bytes=None,
                        flash_available=False)
    return Scheduler(rc, BlockManager(num_blocks, page, True))


def test_chunked_prefill_respects_token_budget():
    s = make_scheduler(64, 4, budget=16)
    s.add(req("a", range(3, 40)))
    s.add(req("b", range(100, 105)))
    batch, _ = s.schedule()
    assert [(x.req.request_id, x.num_tokens) for x in batch] == [("a", 16)]
    assert not batch[0].samples


def test_prefill_first_admits_waiting_before_running():
    s = make_scheduler(64, 4, kind="prefill_first", budget=16)
    a = req("a", range(3, 7))
    s.add(a)
    batch, _ = s.schedule()
    a.num_computed = 4
    a.generated.append(5)  # a is decoding now
    s.add(req("b", range(10, 20)))
    batch, _ = s.schedule()
    assert [x.req.request_id for x in batch] == ["b", "a"]
    assert batch[0].num_tokens == 10 and batch[1].num_tokens == 1


def test_preemption_frees_the_newest_request():
    s = make_scheduler(4, 4, budget=64)
    a, b = req("a", range(3, 11)), req("b", range(20, 28))
    s.add(a)
    s.add(b)
    batch, _ = s.schedule()
    assert len(batch) == 2 and s.blocks.num_free == 0
    for x in batch:
        x.req.num_computed += x.num_tokens
        x.req.generated.append(1)
    batch, _ = s.schedule()  # a needs a third block: b is preempted
    assert [x.req.request_id for x in batch] == ["a"]
    assert b.status == 0 and b.num_computed == 0 and list(s.waiting) == [b]
    assert s.num_preemptions == 1


def test_request_larger_than_cache_is_reported():
    s = make_scheduler(2, 4, budget=64)
    s.add(req("big", range(3, 20)))
    batch, impossible = s.schedule()
    assert len(batch) == 0 and [r.request_id for r in impossible] == ["big"]


def parent_of(rid, tokens, children, n=4):
    """A request asking for 1 + `children` samples, as manager.build_request makes it (driver/api/request_group.py)."""
    r = req(rid, tokens, n)
    r.children = [Request(f"{rid}__child#{i}", list(tokens), n, child_index=i) for i in range(children)]
    return r


def prefill(s, batch):
    """The engine's bookkeeping once a plan is out: the counts, then the forks (Engine.step)."""
    for x in batch:
        x.req.num_computed += x.num_tokens
    s.fork_ready()


def test_children_share_full_prompt_pages_copy_the_partial_one_and_free_their_own():
    s = make_scheduler(8, 4, budget=64)
    p = parent_of("p", range(3, 13), 2)  # 10 tokens: 9 before the last in two full pages and one partial
    s.add(p)
    batch, _ = s.schedule()
    assert [(x.req.request_id, x.num_tokens) for x in batch] == [("p", 10)]
    prefill(s, batch)
    c0, c1 = [r for r in s.running if r is not p]
    assert p.children == [] and (c0.request_id, c1.request_id) == ("p__child#0", "p__child#1")
    for c in (c0, c1):
        assert c.block_ids[:2] == p.block_ids[:2] and c.block_ids[2] not in p.block_ids and c.num_computed == 9
    assert [s.blocks.ref[b] for b in p.block_ids] == [3, 3, 1]
    assert s.forks.copy_unsent(c0)
    assert s.forks.take().tolist() == [[p.block_ids[2], c0.block_ids[2]], [p.block_ids[2], c1.block_ids[2]]]
    p.generated.append(5)  # the parent sampled at the end of its prefill
    batch, _ = s.schedule()  # each child computes the last prompt token itself
    assert sorted((x.req.request_id, x.num_tokens) for x in batch) == [("p", 1), ("p__child#0", 1), ("p__child#1", 1)]
    own = c0.block_ids[2]
    s.preempt(c0)
    assert s.blocks.ref[own] == 0 and [s.blocks.ref[b] for b in p.block_ids[:2]] == [2, 2]
    s.finish(p)  # the parent ends: the pages c1 still reads stay
    assert [s.blocks.ref[b] for b in c1.block_ids] == [1, 1, 1]
    for r in (c0, c1):
        s.finish(r)
    assert s.blocks.num_free == 8 and s.forks.stats.forked_children == 2


def test_a_child_with_no_page_for_its_copy_and_the_children_of_a_cancelled_parent_go_on_alone():
    s = make_scheduler(3, 4, budget=64)
    p = parent_of("p", range(3, 13), 1)
    s.add(p)
    batch, _ = s.schedule()  # three pages: none left for the child's copy of the third
    prefill(s, batch)
    assert [r.request_id for r in s.waiting] == ["p__child#0"] and s.forks.stats.fork_fallbacks == 1
    assert s.waiting.peek().num_computed == 0 and s.forks.take().size == 0
    q = parent_of("q", range(3, 7), 2)
    s.add(q)
    s.finish(q)  # cancelled before its prefill: its children are queued as requests of their own
    assert [r.request_id for r in s.waiting] == ["p__child#0", "q__child#0", "q__child#1"]


def test_a_child_whose_copy_is_not_sent_is_recomputed_not_swapped_out():
    s = make_scheduler(8, 4, budget=64)
    s.host = HostPool(8)  # a host pool the parent's pages would fit in
    p = parent_of("p", range(3, 13), 1)
    s.add(p)
    batch, _ = s.schedule()
    prefill(s, batch)
    (child,) = [r for r in s.running if r is not p]
    s.preempt(child, offload=True)  # its third page is not written yet
    assert child.num_computed == 0 and not s.host.holds(child)
