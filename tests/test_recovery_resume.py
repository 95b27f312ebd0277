"""Resume at TP=1, in process (the manager API): a request resubmitted with the tokens it already delivered
(`resume_tokens`, with their weight versions) continues exactly as the uninterrupted request, greedy and seeded
sampling alike, and its outputs are the uninterrupted request's (docs/recovery.md)."""

from __future__ import annotations

import math

import pytest

from cluster.errors import RequestRejected
from cluster.outputs import RequestStatus

SAMPLED = {"do_sample": True, "temperature": 0.9, "top_k": 50, "seed": 1234}


@pytest.fixture(scope="module")
def manager(make_checkpoint):
    import cluster

    model = cluster.load(make_checkpoint("llama"))
    m = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(
        page_size=16, per_request_processors=True, return_logprobs=True))
    m.start()
    yield m
    m.stop()
    m.destroy()


def run(m, rid: str, **kwargs):
    m.add_request([1, 17, 33, 9, 250], request_id=rid, max_new_tokens=14, **kwargs)
    while True:
        out = m.get_result(rid, timeout=60)
        assert out is not None, "no output within 60 s"
        if out.is_finished():
            return out


def failing_at_step_3(make_checkpoint, monkeypatch):
    """A started TP=1 manager whose driver loop fails at step 3 (an injected fault)."""
    import cluster
    from cluster import faults

    monkeypatch.setattr(faults, "RULES", [("driver_step", {"step": "3"})])
    m = cluster.load(make_checkpoint("llama")).init_continuous_batching(
        continuous_batching_config=cluster.ContinuousBatchingConfig(page_size=16))
    m.start()
    return m


@pytest.mark.parametrize("params", [{}, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [0, 1, 6, 13])
def test_resume_after_k_tokens_is_the_uninterrupted_run(manager, params, k):
    rid = f"r-{k}-{bool(params)}"
    whole = run(manager, rid, **params)
    assert whole.status == RequestStatus.FINISHED and len(whole.generated_tokens) == 14 and whole.resumes == 0
    resumed = run(manager, rid, resume_tokens=whole.generated_tokens[:k], resume_versions=[(0, 0)] if k else [],
                  resumes=1, **params)
    assert resumed.status == RequestStatus.FINISHED
    assert resumed.generated_tokens == whole.generated_tokens  # token for token, the resumed ones included
    assert resumed.prompt_ids == whole.prompt_ids and resumed.resumes == 1
    assert resumed.weight_versions == [(0, 0)]
    assert len(resumed.logprobs) == 14 and all(math.isnan(x) for x in resumed.logprobs[:k])
    assert resumed.logprobs[k:] == pytest.approx(whole.logprobs[k:], abs=1e-5)
    if params:  # sampling really sampled: another seed gives another sequence
        other = run(manager, rid, **(params | {"seed": 99}))
        assert other.generated_tokens != whole.generated_tokens


def test_a_moe_model_resumes_exactly(make_checkpoint):
    """The same on a MoE model (Qwen3-MoE, routing that varies: tests/test_moe.py): the prefill of the prompt and the
    resumed tokens routes them to the experts their decode steps chose, so the rest is the uninterrupted run's, greedy
    and seeded. What a restart adds (the group reloads the served checkpoint with the preset's expert placement, the
    clients resubmit) runs on Qwen3-MoE at TP=2 in tests/test_recovery_chaos.py."""
    import cluster

    model = cluster.load(make_checkpoint("qwen3_moe"))
    cfg = cluster.ContinuousBatchingConfig(page_size=16, per_request_processors=True)
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        for params, k in (({}, 9), (SAMPLED, 4)):
            whole = run(m, f"moe-{k}", **params)
            resumed = run(m, f"moe-{k}", resume_tokens=whole.generated_tokens[:k], resumes=1, **params)
            assert resumed.generated_tokens == whole.generated_tokens and resumed.resumes == 1, (params, k)


def test_resumed_tokens_keep_their_weight_versions(manager):
    whole = run(manager, "versions")
    out = run(manager, "versions", resume_tokens=whole.generated_tokens[:5], resume_versions=[(0, 3), (2, 4)],
              resumes=2)
    assert out.generated_tokens[:5] == whole.generated_tokens[:5]
    assert out.weight_versions == [(0, 3), (2, 4), (5, 0)] and out.weight_version == 3 and out.resumes == 2
    assert [out.version_of_token(i) for i in (0, 1, 2, 4, 5, 13)] == [3, 3, 4, 4, 0, 0]


def test_streamed_outputs_of_a_resume_start_with_the_resumed_tokens(manager):
    whole = run(manager, "stream")
    rid = manager.add_request([1, 17, 33, 9, 250], request_id="stream", max_new_tokens=14, streaming=True,
                              resume_tokens=whole.generated_tokens[:4], resumes=1)
    seen = []
    while not (out := manager.get_result(rid, timeout=60)).is_finished():
        seen.append(len(out.generated_tokens))
    assert seen == list(range(5, 14)) and out.generated_tokens == whole.generated_tokens


@pytest.mark.parametrize("resume, why", [
    ({"resume_tokens": list(range(10, 24))}, "at least one token"),
    ({"resume_tokens": [5, 4096]}, "outside the vocabulary"),
    ({"resume_tokens": [5, "x"]}, "not an integer"),
    ({"resume_tokens": [5, 6], "eos_token_id": 6}, "EOS"),
    ({"resume_tokens": [5, 6], "resume_versions": [(1, 0)]}, "first index is 0"),
    ({"resume_tokens": [5, 6], "resume_versions": [(0, 0), (2, 1)]}, "below len"),
    ({"resume_tokens": [5, 6], "resume_versions": [(0, -1)]}, "non-negative"),
    ({"resumes": -1}, "resumes=-1"),
])
def test_bad_resumes_are_refused(manager, resume, why):
    with pytest.raises(RequestRejected) as e:
        manager.build_request([1, 2, 3], "bad", 14, **resume)
    assert why in e.value.message


def test_a_failed_manager_refuses_new_requests_with_its_failure_code(make_checkpoint, monkeypatch):
    """A submit that reaches a manager whose loop died (a rank lost, the driver failed) is refused with the
    failure's own code, not `stopped`: a resuming client resumes what is refused so (cluster/client/io_thread.py,
    RESUMABLE) once the restarted group serves, as it resumes what was in flight."""
    from cluster.errors import Code, ManagerStopped

    m = failing_at_step_3(make_checkpoint, monkeypatch)
    try:
        rid = m.add_request([1, 17, 33, 9, 250], max_new_tokens=14)
        out = m.get_result(rid, timeout=60)
        assert out is not None and out.status == RequestStatus.FAILED
        with pytest.raises(ManagerStopped, match="the manager is stopped") as refused:
            m.add_request([1, 2, 3], max_new_tokens=2)
        assert refused.value.code == Code.DRIVER_FAILED == m.failure_code
    finally:
        m.stop()
        m.destroy()


def test_a_loop_going_down_says_no_health_and_takes_no_resubmit(make_checkpoint, monkeypatch):
    """The race behind a request resumed twice (issue 25, item 4): a failing loop has ended its requests, so the
    clients resume at once, but its thread still runs. Health must not say ok then, and a resubmit must be refused
    with the failure's code (retried until the restarted group takes it), not accepted by the group going down:
    an accepted resubmit counts a resume, and the dying manager then fails it again."""
    import threading

    from cluster import protocol as P
    from cluster.errors import Code
    from driver.api.driver_loop import DriverLoop
    from driver.frontdoor.request_desk import ClientState, RequestDesk

    closed, release = threading.Event(), threading.Event()
    close = DriverLoop._close

    def held_close(self, *args):  # the loop thread stays alive after it closed the door, as under load
        close(self, *args)
        closed.set()
        release.wait(30)

    monkeypatch.setattr(DriverLoop, "_close", held_close)
    m = failing_at_step_3(make_checkpoint, monkeypatch)
    try:
        rid = m.add_request([1, 17, 33, 9, 250], max_new_tokens=14)
        assert closed.wait(60) and m.get_result(rid, timeout=10).status == RequestStatus.FAILED
        assert m.is_running() and not m.loop_answers(60.0)
        desk = RequestDesk(m, 8, lambda *a, **k: None, lambda *a: True, lambda: None, {"accepted": 0})
        resubmit = P.Submit(mid=1, request_id=rid, input_ids=[1, 17, 33, 9, 250], text=None, max_new_tokens=14,
                            streaming=False, sampling={}, eos_token_id=None, resumes=0)
        with pytest.raises(P.ProtocolError) as refused:
            desk.submit(b"client", ClientState(0.0), resubmit, resubmit.input_ids)
        assert refused.value.code == Code.DRIVER_FAILED == desk.failure_code()
    finally:
        release.set()
        m.stop()
        m.destroy()
