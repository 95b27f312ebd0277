"""A weight-sync group the trainer owns, through SGLang's routes, at TP=2 (one real `lockstep serve --http`): a
trainer process at rank 0 of a gloo group makes slime's calls in slime's order (tests/slime_trainer.py: connect;
per update pause in abort mode, flush, one /update_weights_from_distributed a bucket with its weight_version while
it broadcasts the tensors, continue; destroy), and this process is slime's rollout: generate with logprobs, the
rollout the pause aborted resubmitted from its partial output. Three rounds: no request lost, tokens after each
update equal transformers' on the new weights, weight_version labels as the trainer set them. The logic is tested in
process in tests/test_trainer_group.py."""

from __future__ import annotations

import multiprocessing as mp
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import HTTP_ADMIN_TOKEN, hf_greedy, transformers_greedy
from tests.test_http import http

PROMPT = [1, 17, 33, 250, 9, 400, 77]
NEW = 8
LONG = 400  # the rollout the pause aborts


@pytest.fixture(scope="module")
def server(make_checkpoint):
    from tests.serving import http_serve

    with http_serve(make_checkpoint("llama", seed=3), "push_timeout_s = 4\n") as s:
        yield s


def generate(server, input_ids: list[int], max_new_tokens: int, **sampling) -> dict:
    """slime's rollout call: input_ids, sampling_params, return_logprob."""
    status, out = http(server, "POST", "/generate", {"input_ids": input_ids, "return_logprob": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": max_new_tokens, **sampling}})
    assert status == 200, out
    return out


def running(server) -> int:
    return http(server, "GET", "/server_info")[1]["internal_states"][0]["running"]


def answers_ok(log: list) -> None:
    """Every call the trainer made answered 200 with SGLang's success (a route without `success` answers 200)."""
    for route, status, answer in log:
        assert status == 200 and (not isinstance(answer, dict) or answer.get("success", True)), (route, answer)


@pytest.mark.slow
def test_slime_rounds_with_a_trainer_owned_group(server, make_checkpoint):
    from launch.torchrun import free_port
    from tests import slime_trainer

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    trainer = ctx.Process(target=slime_trainer.run, args=(server.http, HTTP_ADMIN_TOKEN, 2, free_port(), child),
                          daemon=True)
    trainer.start()
    try:
        connected = conn.recv() if conn.poll(120) else pytest.fail("the trainer did not connect")
        answers_ok(connected)
        assert connected[0][2]["message"] == "Succeeded to initialize custom process group."
        first = generate(server, PROMPT, NEW)
        assert first["output_ids"] == hf_greedy(make_checkpoint("llama", seed=3), [PROMPT], NEW)[0]
        assert first["meta_info"]["weight_version"] == "default"
        with ThreadPoolExecutor(1) as pool:
            for version, seed in enumerate((4, 5, 6), 1):
                new_dir = make_checkpoint("llama", seed=seed)
                rollout = pool.submit(generate, server, PROMPT, LONG, ignore_eos=True)
                deadline = time.monotonic() + 60
                while running(server) == 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                conn.send(("update", str(new_dir)))
                partial = rollout.result(timeout=120)  # aborted by the trainer's pause: its tokens so far
                assert partial["meta_info"]["finish_reason"]["type"] == "abort", partial["meta_info"]
                done = partial["output_ids"]
                assert 0 < len(done) < LONG and len(partial["meta_info"]["output_token_logprobs"]) == len(done)
                log = conn.recv() if conn.poll(120) else pytest.fail("the trainer's update did not end")
                answers_ok(log)
                routes = [route for route, _, _ in log]
                assert routes[:2] == ["/pause_generation", "/flush_cache"] and routes[-1] == "/continue_generation"
                buckets = [answer["message"] for route, _, answer in log if route == "/update_weights_from_distributed"]
                assert len(buckets) > 2 and buckets[-1].endswith(f"Weight version updated to {version}."), buckets
                assert all(m.startswith("Staged") for m in buckets[:-1]), buckets  # nothing applied before the end
                assert http(server, "GET", "/get_weight_version")[1] == {"weight_version": str(version)}
                again = generate(server, PROMPT + done, NEW)  # slime's partial rollout: prompt and tokens so far
                assert again["output_ids"] == transformers_greedy(new_dir, [PROMPT + done], NEW)[0]
                fresh = generate(server, PROMPT, NEW)
                assert fresh["output_ids"] == hf_greedy(new_dir, [PROMPT], NEW)[0]
                for out in (again, fresh):
                    assert out["meta_info"]["weight_version"] == str(version)
                    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        conn.send(("stop",))
        destroyed = conn.recv() if conn.poll(60) else pytest.fail("the trainer did not disconnect")
        answers_ok(destroyed)
        trainer.join(30)
        assert trainer.exitcode == 0
        health = http(server, "GET", "/health")
        assert health[0] == 200, health
    finally:
        if trainer.is_alive():
            trainer.kill()
