"""The persistent batch (driver/engine/persistent_batch.py) against a plain per-request model: random sequences of
joins, steps (serial and overlapped: tokens pending), preemptions and cancels run on two schedulers at once, one
with its requests' counts and block tables in the arrays, one with plain per-request fields served one request at
a time; after every operation both hold the same requests with the same counts, pages and tokens, every row of the
arrays equals its request, and each step's plan built from the arrays equals the plan built request by request."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cluster.config import ContinuousBatchingConfig, resolve_config
from cluster.outputs import RequestStatus
from driver.engine.block_manager import BlockManager, token_slice
from driver.engine.engine import Engine, InFlight, decode_first
from driver.engine.persistent_batch import NO_TOKEN, PersistentBatch
from driver.engine.request import Request, SamplingParams
from driver.engine.scheduler import Scheduler


class NoRows(PersistentBatch):
    """The plain model: requests never get a row, so their counts stay plain fields."""

    def join(self, req: Request) -> None:
        pass


def scheduler(plain: bool, rng: random.Random) -> Scheduler:
    rc = resolve_config(ContinuousBatchingConfig(page_size=4, num_blocks=rng.choice([12, 24, 64]),
                                                 max_batch_tokens=rng.choice([8, 16, 48]), max_requests_per_batch=6,
                                                 allow_block_sharing=True, scheduler_type=rng.choice(
                                                     ["fifo", "prefill_first"])),
                        device_kind="cpu", max_model_len=40, kv_bytes_per_token=1, free_bytes=None,
                        flash_available=False)
    s = Scheduler(rc, BlockManager(rc.num_blocks, rc.page_size, True))
    if plain:
        s.batch = NoRows(rc.max_model_len)
        s._continue = s._continue_one_by_one
    return s


def reference_plan(batch, row_of: dict[int, int]) -> tuple:
    """The STEP plan's arrays built one request at a time (the per-request code the arrays replaced)."""
    ids, q, kv, sample = [], [], [], []
    width = max(len(s.req.block_ids) for s in batch)
    for s in batch:
        r = s.req
        start, stop = r.num_computed, r.num_computed + s.num_tokens
        p, known = len(r.prompt_ids), len(r.prompt_ids) + len(r.generated)
        if r.num_pending and start == known + r.num_pending - 1:
            ids.append(-1 - row_of[id(r)])
        elif stop == known and start == known - 1 and start >= p:
            ids.append(r.generated[start - p])
        else:
            ids.extend(token_slice(r, start, min(stop, known)))
            if stop > known:
                ids.append(-1 - row_of[id(r)])
        q.append(s.num_tokens)
        kv.append(stop)
        sample.append(int(stop == known + r.num_pending))
    tables = [s.req.block_ids + [0] * (width - len(s.req.block_ids)) for s in batch]
    return ids, q, kv, sample, tables


def state(s: Scheduler) -> list[tuple]:
    held = sorted(list(s.running) + list(s.waiting), key=lambda r: r.request_id)
    return [(r.request_id, r.num_computed, r.num_pending, list(r.block_ids), list(r.generated), int(r.status))
            for r in held]


def check_rows(s: Scheduler) -> None:
    """Every held request's row equals the request; rows of no request hold no pages."""
    b = s.batch
    held = list(s.running) + list(s.waiting)
    for r in held:
        assert r.batch is b and b.reqs[r.slot] is r
        n = len(r.block_ids)
        assert b.num_pages[r.slot] == n and b.pages[r.slot, :n].tolist() == r.block_ids
        assert not b.pages[r.slot, n:].any()
        assert b.prompt_len[r.slot] == len(r.prompt_ids)
        assert b.limit[r.slot] == min(len(r.prompt_ids) + r.max_new_tokens, 40)
        assert sorted(t for t in b.eos[r.slot].tolist() if t != NO_TOKEN) == sorted(r.eos_token_ids)
    assert sorted(r.slot for r in held) == sorted(i for i, x in enumerate(b.reqs) if x is not None)
    for i, x in enumerate(b.reqs):
        if x is None:
            assert b.num_pages[i] == 0 and not b.pages[i].any()


@pytest.mark.parametrize("seed", range(40))
def test_random_joins_steps_preemptions_and_cancels_keep_the_arrays_equal_to_the_requests(seed):
    rng = random.Random(seed)
    arrays, plain = scheduler(False, random.Random(seed)), scheduler(True, random.Random(seed))
    engine = Engine.__new__(Engine)  # only its plan builder: the arrays' scheduler, no runner or group
    engine.scheduler, engine.step_no, engine.weight_version, engine.in_flight = arrays, 0, 0, None
    pending: list[tuple[Request, Request, int]] = []  # overlapped: tokens sampled, not on the host yet
    row_of: dict[int, int] = {}
    made = 0
    for _ in range(120):
        op = rng.random()
        if op < 0.25 or made < 2:
            prompt = [rng.randrange(1, 9) for _ in range(rng.randint(1, 14))]  # few ids: prefixes are shared
            kw = dict(max_new_tokens=rng.randint(1, 10), eos_token_ids=frozenset(rng.sample(range(1, 9), 1)),
                      sampling=SamplingParams(repetition_penalty=rng.choice([1.0, 1.0, 1.3])),
                      client=rng.choice("abc"))  # clients share rows, tokens and pages (fair_share.py)
            children = rng.choice([0, 0, 1, 3])  # n samples: forked after the prefill (driver/engine/fork.py)
            for s in (arrays, plain):
                req = Request(f"r{made}", list(prompt), **kw)
                req.children = [Request(f"r{made}__child#{i}", list(prompt), child_index=i, **kw)
                                for i in range(children)]
                s.add(req)
            made += 1
        elif op < 0.35:  # preempt or cancel the same request in both
            running = sorted(arrays.running, key=lambda r: r.request_id)
            if running:
                rid = rng.choice(running).request_id
                cancel = rng.random() < 0.5
                for s in (arrays, plain):
                    req = next(r for r in s.running if r.request_id == rid)
                    if cancel:
                        req.status = RequestStatus.CANCELLED
                        s.finish(req)
                    elif not req.num_pending:
                        s.preempt(req, offload=False)
        else:  # one step as the engine runs it: schedule, plan, counts; the step before lands; this one samples
            batch_a, impossible_a = arrays.schedule()
            batch_p, impossible_p = plain.schedule()
            assert [(x.req.request_id, x.num_tokens) for x in batch_a] == \
                   [(x.req.request_id, x.num_tokens) for x in batch_p]
            assert [r.request_id for r in impossible_a] == [r.request_id for r in impossible_p]
            for s, impossible in ((arrays, impossible_a), (plain, impossible_p)):
                for r in impossible:
                    r.status = RequestStatus.FAILED
                    s.finish(r)
            batch_a, batch_p = decode_first(batch_a), decode_first(batch_p)
            samples: list[int] = []
            if batch_a:
                engine.in_flight = InFlight([], [], 0, np.array(
                    [row_of.get(id(r), -1) for r in arrays.batch.reqs], np.int64)) if row_of else None
                plan, _ = engine._plan(batch_a)
                want = reference_plan(list(batch_a), row_of)
                assert (plan.input_ids.tolist(), plan.q_lens.tolist(), plan.kv_lens.tolist(), plan.sample.tolist(),
                        plan.block_tables.tolist()) == want
                assert want == reference_plan(list(batch_p), {id(p): row_of.get(id(a)) for a, p in
                                                              zip(batch_a.reqs, batch_p.reqs)})
                samples = plan.sample.tolist()
                for a, p, n in zip(batch_a.reqs, batch_p.reqs, batch_a.num_tokens):
                    for r in (a, p):
                        r.num_computed += n
                for s in (arrays, plain):  # as Engine.step: the plan is out, parents fork
                    s.fork_ready()
                    s.forks.take()
            landing, pending, row_of = pending, [], {}
            for a, p, tok in landing:  # the step before: its tokens reach the host
                for r in (a, p):
                    r.num_pending -= 1
                    if not r.is_finished:
                        r.generated.append(tok)
            overlapped = rng.random() < 0.5
            for a, p, sampled in zip(batch_a.reqs, batch_p.reqs, samples):
                if sampled and not a.is_finished:
                    tok = rng.randrange(1, 9)
                    if overlapped:
                        a.num_pending += 1
                        p.num_pending += 1
                        row_of[id(a)] = len(row_of)
                        pending.append((a, p, tok))
                    else:
                        for r in (a, p):
                            r.generated.append(tok)
            landed = [(a, p) for a, p, _ in landing] + [
                (a, p) for a, p, sampled in zip(batch_a.reqs, batch_p.reqs, samples) if sampled and not overlapped]
            for a, p in landed:
                for s, r in ((arrays, a), (plain, p)):
                    if not r.is_finished and r.generated and (
                            r.generated[-1] in r.eos_token_ids or len(r.generated) >= r.max_new_tokens
                            or r.num_tokens >= 40):
                        r.status = RequestStatus.FINISHED
                        s.finish(r)
            for s, reqs in ((arrays, batch_a.reqs), (plain, batch_p.reqs)):
                for r in reqs:
                    if not r.is_finished:
                        s.blocks.register_full_blocks(r)
        assert state(arrays) == state(plain)
        check_rows(arrays)
        check_pages(arrays)
        check_pages(plain)
    assert made > 10 and arrays.num_preemptions == plain.num_preemptions
    assert arrays.forks.stats == plain.forks.stats


def check_pages(s: Scheduler) -> None:
    """Every page's reference count is the number of held requests holding it (forked samples share pages); the
    free pages are exactly those nobody holds."""
    held = [0] * s.blocks.num_blocks
    for r in list(s.running) + list(s.waiting):
        for b in r.block_ids:
            held[b] += 1
    assert s.blocks.ref == held
    assert sorted(s.blocks.free) == [b for b in range(s.blocks.num_blocks) if held[b] == 0]
