"""SGLang's native routes (launch/gateway/sglang_routes.py) over one real TP=2 `lockstep serve --http`, following
slime's calls: generate with logprobs, pause (SGLang's default mode: abort) with a rollout in flight, its partial
output resubmitted, flush, update from disk with a weight_version label, continue, for two rounds; the resubmitted
and new rollouts equal transformers' greedy tokens on the new weights, labels as set. Also abort_request, stream,
memory release, server and model info, health_generate."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.conftest import hf_greedy, transformers_greedy
from tests.test_http import http

TOKEN = "sglang-test-token"
PROMPT = [1, 17, 33, 250, 9, 400, 77]
NEW = 8


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint("llama", seed=3)


@pytest.fixture(scope="module")
def server(model_dir):
    """One TP=2 server with an admin token, shared by this module's tests."""
    from launch.torchrun import free_port
    from tests.serving import fast_config, serve

    port = free_port()
    with serve(model_dir, 2, fast_config() + f'http_admin_token = "{TOKEN}"\n',
               extra=["--http", f"127.0.0.1:{port}"], forked=True) as s:
        s.http = f"http://127.0.0.1:{port}"
        yield s


def generate(server, input_ids: list[int], **sampling) -> dict:
    status, out = http(server, "POST", "/generate", {"input_ids": input_ids, "return_logprob": True,
                                                     "sampling_params": {"temperature": 0, **sampling}})
    assert status == 200, out
    return out


def admin(server, path: str, body: dict | None = None, method: str = "POST") -> tuple[int, dict]:
    return http(server, method, path, body, token=TOKEN)


@pytest.mark.slow
def test_slime_rounds(server, model_dir, make_checkpoint):
    from transformers import AutoModelForCausalLM

    first = generate(server, PROMPT, max_new_tokens=NEW)
    assert first["output_ids"] == hf_greedy(model_dir, [PROMPT], NEW)[0]
    meta = first["meta_info"]
    assert meta["weight_version"] == "default" and meta["prompt_tokens"] == len(PROMPT)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == first["output_ids"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + first["output_ids"]])).logits[0, len(PROMPT) - 1:-1].log_softmax(-1)
    want = logits.gather(1, torch.tensor(first["output_ids"])[:, None])[:, 0].tolist()
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(want, abs=1e-4)
    assert meta["finish_reason"]["type"] in ("stop", "length")

    with ThreadPoolExecutor(2) as pool:
        for round_no, seed in enumerate((4, 5), 1):
            rollout = pool.submit(generate, server, PROMPT, max_new_tokens=400, ignore_eos=True)
            time.sleep(1.0)  # the rollout runs
            assert admin(server, "/pause_generation", {})[0] == 200  # SGLang's default mode: abort
            partial = rollout.result(timeout=60)
            assert partial["meta_info"]["finish_reason"]["type"] == "abort"
            done = partial["output_ids"]
            assert 0 < len(done) < 400
            assert admin(server, "/flush_cache", method="GET")[0] == 200
            new_dir = make_checkpoint("llama", seed=seed)
            status, body = admin(server, "/update_weights_from_disk", {"model_path": str(new_dir),
                                                                       "weight_version": f"v{round_no}"})
            assert status == 200 and body["success"], body
            assert http(server, "GET", "/get_weight_version")[1] == {"weight_version": f"v{round_no}"}
            resubmitted = pool.submit(generate, server, PROMPT + done, max_new_tokens=NEW)  # queued while paused
            assert admin(server, "/continue_generation", {})[0] == 200
            again = resubmitted.result(timeout=120)
            # the partial length varies run to run: transformers' reference is not cached (tests/references)
            assert again["output_ids"] == transformers_greedy(new_dir, [PROMPT + done], NEW)[0]
            assert again["meta_info"]["weight_version"] == f"v{round_no}"
            fresh = generate(server, PROMPT, max_new_tokens=NEW)
            assert fresh["output_ids"] == hf_greedy(new_dir, [PROMPT], NEW)[0]


@pytest.mark.slow
def test_abort_stream_memory_and_info(server):
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(http, server, "POST", "/generate", {"input_ids": PROMPT, "rid": "long-1",
                                                              "sampling_params": {"max_new_tokens": 400,
                                                                                  "ignore_eos": True}})
        time.sleep(1.0)
        status, body = admin(server, "/abort_request", {"abort_all": True})
        assert status == 200 and "long-1" in body["aborted"]
        assert long.result(timeout=60)[1]["meta_info"]["finish_reason"]["type"] == "abort"
    req = urllib.request.Request(server.http + "/generate", method="POST", data=json.dumps(
        {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["finish_reason"] is not None and len(last["output_ids"]) <= 4
    assert http(server, "POST", "/pause_generation", {})[0] in (401, 403)  # admin routes need the token
    assert admin(server, "/pause_generation", {"mode": "in_place"})[0] == 200
    assert admin(server, "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert admin(server, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert admin(server, "/continue_generation")[0] == 200
    status, info = http(server, "GET", "/server_info")
    assert status == 200 and info["tp_size"] == 2 and info["model_path"] and info["context_length"] == 1024
    assert http(server, "GET", "/model_info")[1]["is_generation"] is True
    assert http(server, "GET", "/health_generate")[0] == 200
