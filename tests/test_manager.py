"""The seed's ContinuousBatchingManager on every rank (TP=1 and TP=2): streaming, cancel, pause with a weight
change, stop variants, the queue limit and result handlers, with other requests in flight that still match
transformers token for token."""

from __future__ import annotations

import pytest

from cluster.outputs import RequestStatus
from tests.conftest import hf_greedy, read_json, run_ranks
from tests.workloads import mixed_prompts


def check(rec: dict, dir_a, dir_b, vocab: int) -> None:
    prompts = mixed_prompts(vocab)
    assert rec["is_running"] and rec["paused_loop_alive"] and rec["stopped"]
    # in-flight requests are exact under A, and the ones started after the pause are exact under B
    assert rec["background"] == [t[:24] for t in hf_greedy(dir_a, prompts[:8])]
    assert rec["after_pause_b"] == [t[:24] for t in hf_greedy(dir_b, prompts[10:12])]
    assert rec["inflight"] == [[16, RequestStatus.FINISHED]] * 2
    # streaming: one output per token, cumulative, the last one final, the same tokens as transformers
    assert rec["stream"] == [[i, RequestStatus.DECODING] for i in range(1, 6)] + [[6, RequestStatus.FINISHED]]
    assert rec["stream_tokens"] == hf_greedy(dir_a, [prompts[8]])[0][:6]
    # cancel: one final CANCELLED output, long before max_new_tokens, and every page back
    assert rec["cancel"]["status"] == RequestStatus.CANCELLED and rec["cancel"]["n_final"] == 1
    assert 1 <= rec["cancel"]["tokens"] < 400
    assert rec["free_blocks"]
    # result handler: every token through the asyncio loop, then cleaned up
    assert rec["handler"]["seen"] == [1, 2, 3, 4, 5] and not rec["handler"]["handler_left"]
    assert rec["handler"]["tokens"] == hf_greedy(dir_a, [prompts[3]])[0][:5]
    # stop(keep_for_next_session) keeps the manager and its cache for the next call; destroy is idempotent
    assert rec["kept"] and rec["reused"] and rec["destroyed"]
    assert rec["reused_tokens"] == hf_greedy(dir_a, [prompts[4]])[0][:4]
    # the queue limit fails at once, with a clear error
    assert "queue is full (max_queue_size=2)" in rec["queue_full"] and rec["queue_full_s"] < 0.5
    # a hard stop fails what is pending, saying why
    assert [s for s, _ in rec["hard_stop"]] == [RequestStatus.FAILED] * 2
    assert all("hard_stop" in e for _, e in rec["hard_stop"])


@pytest.mark.slow
def test_manager_tp1(make_checkpoint):
    from tests.scripts.manager_rank import run

    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    rec = run(str(dir_a), str(dir_b))
    check(rec, dir_a, dir_b, 2048)


@pytest.mark.slow
def test_manager_tp2(make_checkpoint, tmp_path):
    dir_a, dir_b = make_checkpoint("llama"), make_checkpoint("llama", seed=1)
    base = tmp_path / "rec"
    proc = run_ranks("manager_rank.py", [str(dir_a), str(dir_b), str(base)])
    assert proc.returncode == 0, proc.stdout[-4000:]
    check(read_json(f"{base}.rank0"), dir_a, dir_b, 2048)
    worker = read_json(f"{base}.rank1")
    assert worker["worker_add_request_is_none"]
    assert worker["worker_finished"] == 10 and worker["worker_finished_2"] == 4  # results reach rank 1 too
    assert worker["kept"] and worker["reused"] and worker["destroyed"]
    assert worker["worker_reused_finished"] == 1  # the reused session's output reached rank 1 (no 120 s wait)
