"""Fair scheduling on rank 0 (issues 25 and 37): clients take turns for admission, `priority` orders requests strictly
(lower first, FCFS within one), a client holding more than its share of the rows or pages gives way to another's
waiting request, the step's tokens are shared across clients, preemption takes the lowest-priority request of the
client holding most, its newest; the front door hands in a client under its share past the manager's queue cap."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np

from cluster.config import ContinuousBatchingConfig, resolve_config
from driver.engine.block_manager import BlockManager
from driver.engine.fair_queue import FairQueue
from driver.engine.fair_share import fair_split
from driver.engine.request import LOCAL_CLIENT, Request
from driver.engine.scheduler import Scheduler
from driver.frontdoor.admission import Ticket
from driver.frontdoor.request_desk import RequestDesk


FIRST_TOKENS = itertools.count(1)  # every prompt its own tokens: no prefix is shared


def req(rid: str, client: object = LOCAL_CLIENT, priority: int = 0, tokens: int = 3, new: int = 4) -> Request:
    first = next(FIRST_TOKENS) % 30000
    return Request(request_id=rid, prompt_ids=[first] * tokens, max_new_tokens=new, client=client,
                   priority=priority)


def scheduler(num_blocks: int = 4096, page: int = 4, budget: int = 256, batch: int = 8) -> Scheduler:
    rc = resolve_config(ContinuousBatchingConfig(page_size=page, num_blocks=num_blocks, max_batch_tokens=budget,
                                                 max_requests_per_batch=batch, scheduler_type="fifo"),
                        device_kind="cpu", max_model_len=256, kv_bytes_per_token=1, free_bytes=None,
                        flash_available=False)
    return Scheduler(rc, BlockManager(num_blocks, page, True))


def step(s: Scheduler) -> list[str]:
    """One schedule, its tokens taken as computed (one generated token for each row that samples)."""
    return [rid for rid, _ in step_tokens(s)]


def step_tokens(s: Scheduler) -> list[tuple[str, int]]:
    """`step`, with each row's query tokens."""
    batch, impossible = s.schedule()
    assert impossible == []
    for x in batch:
        samples = x.samples
        x.req.num_computed += x.num_tokens
        if samples:
            x.req.generated.append(7)
    return [(x.req.request_id, x.num_tokens) for x in batch]


def drain(q: FairQueue) -> list[str]:
    out = []
    while q:
        assert q.peek() is (r := q.pop())
        out.append(r.request_id)
    return out


def test_a_flood_of_one_client_does_not_delay_another_clients_request():
    s = scheduler(batch=8)
    for k in range(3000):
        s.add(req(f"a{k}", client=b"flood"))
    flood = [f"a{k}" for k in range(8)]
    assert step(s) == flood  # the batch is full of the flood
    s.add(req("b0", client=b"other"))
    assert step(s) == flood[:7] + ["b0"]  # the flood's newest gives its row back at the next step
    assert s.waiting.peek().request_id == "a7" and s.num_preemptions == 1  # first of its own client's queue
    assert step(s) == flood[:7] + ["b0"]  # and it does not take the row back: the flood holds more than its share
    s.finish(s.running[-1])  # b0 finished: its next request, sent one at a time, gets a row at once as well
    s.add(req("b1", client=b"other"))
    assert step(s) == flood[:7] + ["b1"]
    assert s.num_preemptions == 1 and len(s.waiting) == 3000 - 7


def test_room_right_away_admits_the_other_client_at_the_next_step():
    s = scheduler(batch=4)
    for k in range(3000):
        s.add(req(f"a{k}", client=b"flood"))
    s.add(req("b0", client=b"other"))
    assert step(s) == ["a0", "b0", "a1", "a2"]  # clients in turn: the flood's oldest, then the other's


def test_clients_take_turns_and_each_is_first_come_first_served():
    q = FairQueue()
    for rid, client in [("a0", "A"), ("a1", "A"), ("a2", "A"), ("b0", "B"), ("c0", "C"), ("b1", "B")]:
        q.append(req(rid, client))
    assert [r.request_id for r in q] == ["a0", "b0", "c0", "a1", "b1", "a2"]  # the order iteration shows
    assert drain(q) == ["a0", "b0", "c0", "a1", "b1", "a2"]


def test_a_client_with_nothing_waiting_goes_before_clients_being_served():
    q = FairQueue()
    for k in range(5):
        q.append(req(f"a{k}", "A"))
    assert q.pop().request_id == "a0"
    q.append(req("b0", "B"))
    assert q.pop().request_id == "b0"  # B had nothing waiting: it is next, however many A has
    assert q.pop().request_id == "a1"
    q.append(req("b1", "B"))  # B's next request, sent after its first ended
    q.append(req("c0", "C"))
    assert drain(q) == ["b1", "c0", "a2", "a3", "a4"]  # fresh clients by arrival, then A


def test_priority_is_strict_then_first_come_first_served():
    q = FairQueue()
    for rid, priority in [("p3", 3), ("p0a", 0), ("pm1", -1), ("p1", 1), ("p0b", 0), ("p3b", 3)]:
        q.append(req(rid, priority=priority))
    assert drain(q) == ["pm1", "p0a", "p0b", "p1", "p3", "p3b"]


def test_priority_comes_before_fairness_and_fairness_within_a_priority():
    q = FairQueue()
    for rid, client, priority in [("a0", "A", 1), ("a1", "A", 1), ("a2", "A", 0), ("b0", "B", 1), ("b1", "B", 0)]:
        q.append(req(rid, client, priority))
    assert drain(q) == ["a2", "b1", "a0", "b0", "a1"]


def test_cancelled_requests_leave_the_queue_and_turns_stay_right():
    q = FairQueue()
    a = [req(f"a{k}", "A") for k in range(3)]
    b = req("b0", "B")
    for r in a + [b]:
        q.append(r)
    q.remove(a[0])  # the head of A
    q.remove(b)  # B leaves altogether
    assert a[0] not in q and b not in q and len(q) == 2
    q.append(req("c0", "C"))
    assert drain(q) == ["a1", "c0", "a2"]


def test_a_preempted_request_comes_back_before_new_requests_of_its_priority():
    q = FairQueue()
    q.append(req("new", "A"))
    q.append(req("urgent", "B", priority=-5))
    old = req("old", "C")
    q.push_front(old)
    assert drain(q) == ["urgent", "old", "new"]


def test_waiting_requests_run_by_priority():
    s = scheduler(batch=2)
    for rid, priority in [("low", 5), ("mid", 1), ("high", 0), ("mid2", 1)]:
        s.add(req(rid, priority=priority))
    assert step(s) == ["high", "mid"]
    assert [r.request_id for r in s.waiting] == ["mid2", "low"]


def test_preemption_takes_the_lowest_priority_then_the_newest():
    # pages of 4 tokens: "a" (8 tokens) needs a third page at the next step, the others (6) do not
    s = scheduler(num_blocks=8, page=4)
    reqs = {rid: req(rid, priority=p, tokens=n) for rid, p, n in [("a", 0, 8), ("b", 0, 6), ("low", 2, 6), ("c", 0, 6)]}
    for r in reqs.values():
        s.add(r)
    assert step(s) == ["a", "b", "c", "low"]  # admitted by priority
    assert s.blocks.num_free == 0
    assert step(s) == ["a", "b", "c"]  # "low" is preempted, though "c" is newer
    assert list(s.waiting) == [reqs["low"]] and s.num_preemptions == 1


def test_preemption_within_one_priority_takes_the_newest():
    s = scheduler(num_blocks=6, page=4)
    reqs = {rid: req(rid, tokens=n) for rid, n in [("a", 8), ("b", 6), ("c", 6)]}
    for r in reqs.values():
        s.add(r)
    assert step(s) == ["a", "b", "c"]
    assert step(s) == ["a", "b"]
    assert list(s.waiting) == [reqs["c"]] and s.num_preemptions == 1


def test_a_client_under_its_share_of_pages_gets_them_from_a_client_over_it():
    s = scheduler(num_blocks=8, page=4)
    for rid in ("a0", "a1"):
        s.add(req(rid, client="A", tokens=15))  # 4 pages each: every page is A's
    assert step(s) == ["a0", "a1"] and s.blocks.num_free == 0
    s.add(req("b0", client="B"))
    assert step(s) == ["a0", "b0"]  # A's newest gave its pages back (share: 4 of 8)
    assert [r.request_id for r in s.waiting] == ["a1"] and s.num_preemptions == 1


def test_a_waiting_request_does_not_take_the_row_of_a_higher_priority_one():
    s = scheduler(batch=2)
    for rid in ("a0", "a1"):
        s.add(req(rid, client="A"))
    assert step(s) == ["a0", "a1"]
    s.add(req("b0", client="B", priority=1))
    assert step(s) == ["a0", "a1"] and s.num_preemptions == 0
    s.add(req("c0", client="C", priority=0))  # the same priority: A's newest gives way
    assert step(s) == ["a0", "c0"] and s.num_preemptions == 1


def test_the_step_budget_is_shared_across_clients():
    s = scheduler(budget=64)
    s.add(req("a0", client="A", tokens=200))
    s.add(req("a1", client="A", tokens=200))
    assert step_tokens(s) == [("a0", 64)]
    s.add(req("b0", client="B", tokens=40))
    assert step_tokens(s) == [("a0", 32), ("b0", 32)]  # B's prefill is not starved by A's: half the budget each
    assert step_tokens(s) == [("a0", 56), ("b0", 8)]  # B wants less than its half: A takes what is left


def test_pages_running_out_preempt_the_newest_of_the_client_holding_most():
    s = scheduler(num_blocks=5, page=4)
    for rid, tokens in [("a", 7), ("b", 2), ("d", 2)]:
        s.add(req(rid, client="A", tokens=tokens))
    assert step(s) == ["a", "b", "d"]
    s.add(req("c", client="B", tokens=2))
    assert step(s) == ["a", "b", "d", "c"] and s.blocks.num_free == 0
    assert step(s) == ["a", "b", "c"]  # "a" needs a third page: A holds 3 rows, so its newest goes, not B's "c"
    assert [r.request_id for r in s.waiting] == ["d"] and s.num_preemptions == 1


def test_fair_split_gives_each_client_its_share_then_what_is_left_in_order():
    got = fair_split(np.array([0, 0, 1, 0, 1]), np.array([100, 100, 10, 100, 100]), 256)
    assert got.tolist() == [100, 46, 10, 0, 100]  # shares of 128: 100 + 28 and 10 + 100, then 18 left to row 1
    assert fair_split(np.zeros(3, np.int64), np.array([100, 100, 100]), 150).tolist() == [100, 50, 0]  # one: FCFS
    assert fair_split(np.array([0, 1, 1]), np.ones(3, np.int64), 2).tolist() == [1, 1, 0]  # rows: one a client


def test_a_request_that_gave_way_waits_for_its_clients_turn():
    q = FairQueue()
    a = [req(f"a{k}", "A") for k in range(3)]
    for r in a + [req("b0", "B")]:
        q.append(r)
    assert [q.pop().request_id for _ in range(2)] == ["a0", "b0"]
    q.requeue(a[0])  # a0 ran, then gave its row to B's request: A counts as just served
    q.append(req("b1", "B"))
    assert drain(q) == ["b1", "a0", "a1", "a2"]


def test_the_front_door_hands_in_a_client_under_its_share_past_the_managers_queue_cap():
    taken: list[str] = []
    config = SimpleNamespace(max_requests_per_batch=2, cpu_group_timeout=5.0)
    manager = SimpleNamespace(effective_config=config, engine=SimpleNamespace(scheduler=SimpleNamespace(waiting=[])),
                              submit=lambda r, sink: taken.append(r.request_id))
    desk = RequestDesk(manager, 100, lambda *a, **k: None, lambda *a: True, lambda: None, {})

    def queue(rid: str, client: bytes) -> Ticket:
        ticket = Ticket(rid, client, False, req(rid, client))
        desk.admission.put(ticket)
        return ticket

    for k in range(10):
        queue(f"a{k}", b"A")
    desk.admit()
    assert taken == ["a0", "a1", "a2", "a3"]  # the cap: twice the batch in the manager
    b = [queue(f"b{k}", b"B") for k in range(3)]
    desk.admit()
    assert taken[4:] == ["b0", "b1"]  # B holds less than its share (2 of 4): in; A stays out
    b[0].answered = True  # (its owner was answered: deliver only counts it out)
    desk.deliver(b[0], SimpleNamespace(is_finished=lambda: True))
    desk.admit()
    assert taken[6:] == ["b2"] and desk.in_manager_of == {b"A": 4, b"B": 2}  # b0 ended: B's next goes in
