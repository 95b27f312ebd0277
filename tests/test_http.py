"""The OpenAI-compatible HTTP gateway against one TP=2 `lockstep serve --http`, with the official `openai` client:
completions and chat (text equal to the tokenizer's decoding of transformers' greedy tokens), streaming, stop, n,
seed, usage, disconnects that cancel, error bodies, /metrics through prometheus_client's parser, admin routes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.client import Client
from cluster.errors import ClientError, Code
from launch.gateway.server import Gateway, settings_for
from launch.gateway.child import GatewayProcess
from launch.torchrun import free_port
from tests.conftest import HTTP_ADMIN_TOKEN, hf_greedy

pytestmark = pytest.mark.slow  # one TP=2 server (tests/test_http_shapes.py: the gateway's logic in process)

TOKEN = HTTP_ADMIN_TOKEN
NEW = 12
PROMPT_IDS = [1, 17, 33, 250, 9, 400, 77]


@pytest.fixture(scope="module")
def model_dir(make_checkpoint):
    return make_checkpoint("llama", seed=3)


@pytest.fixture(scope="module")
def server(http_server):
    return http_server  # tests/conftest.py: shared with tests/test_http_openai.py


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def expected_text(tok, ids: list[int], model_dir) -> str:
    return tok.decode(hf_greedy(model_dir, [ids], NEW)[0], skip_special_tokens=True)


def http(server, method: str, path: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict | str]:
    req = urllib.request.Request(server.http + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None)
    req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw, status = r.read().decode(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(), e.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client: name{labels} -> value."""
    with urllib.request.urlopen(server.http + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def cancelled(server) -> int:
    with Client(server.address) as c:
        return c.stats()["metrics"]["request_success"].get("cancelled", 0)


# ------------------------------------------------------------------ completions and chat
def test_completions_text_equals_transformers(oai, tok, model_dir):
    text_prompt = tok.decode(PROMPT_IDS[1:])
    for prompt, ids in ((PROMPT_IDS, PROMPT_IDS), (text_prompt, tok(text_prompt)["input_ids"])):
        r = oai.completions.create(model=model_dir.name, prompt=prompt, max_tokens=NEW, temperature=0)
        want = expected_text(tok, ids, model_dir)
        assert r.choices[0].text == want
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == NEW
        assert r.choices[0].finish_reason == "length"
        chunks = list(oai.completions.create(model=model_dir.name, prompt=prompt, max_tokens=NEW, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].usage.completion_tokens == NEW and chunks[-2].choices[0].finish_reason == "length"


def test_chat_text_equals_transformers(oai, tok, model_dir):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is a tensor?"}]
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    want = expected_text(tok, ids, model_dir)
    r = oai.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=NEW, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ids)
    stream = oai.chat.completions.create(model=model_dir.name, messages=messages, max_tokens=NEW, temperature=0,
                                         stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_stop_trims_and_ends(server, oai, tok, model_dir):
    want = expected_text(tok, PROMPT_IDS, model_dir)
    stop = want[len(want) // 2:len(want) // 2 + 3]
    cut = want[:want.index(stop)]
    before = metrics(server)
    r = oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=NEW, temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    stopped, cancels = (f"lockstep:request_success_total{{finished_reason={r}}}" for r in ("stop", "cancelled"))
    deadline = time.monotonic() + 10  # the loop ends it on the server after the client got its answer
    while (after := metrics(server))[stopped] == before[stopped] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert after[stopped] - before[stopped] == 1 and after[cancels] == before[cancels]  # counted as a stop
    chunks = list(oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=NEW, temperature=0,
                                         stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_seed_and_usage(oai, model_dir):
    def call(seed: int):
        return oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=6, n=3, temperature=1.0,
                                      seed=seed, logprobs=1)
    with ThreadPoolExecutor(2) as pool:  # identical seeded calls at once: both run, and sample alike
        a, b = pool.map(call, [7, 7])
    c = call(8)
    tokens = [[ch.logprobs.tokens for ch in r.choices] for r in (a, b, c)]
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert tokens[0] == tokens[1]  # the same seed: the same samples
    assert tokens[0] != tokens[2]
    assert len({tuple(t) for t in tokens[0]}) > 1  # the choices are distinct samples
    assert a.usage.completion_tokens == 18 and a.usage.prompt_tokens == len(PROMPT_IDS)
    assert all(lp <= 0 for ch in a.choices for lp in ch.logprobs.token_logprobs)


# ------------------------------------------------------------------ disconnects
def test_disconnect_mid_stream_cancels(server, oai, model_dir):
    before = cancelled(server)
    stream = oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=400, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    # paused, the request cannot finish its 400 tokens before a loaded gateway notices the close (CI saw it do so)
    assert http(server, "POST", "/pause", token=TOKEN) == (200, {"paused": True, "mode": "keep"})
    try:
        stream.close()
        deadline = time.monotonic() + 30
        while cancelled(server) == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cancelled(server) == before + 1
    finally:
        assert http(server, "POST", "/resume", token=TOKEN) == (200, {"paused": False})


def test_disconnect_while_waiting_cancels(server, model_dir):
    before = cancelled(server)
    impatient = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=400)
    deadline = time.monotonic() + 10
    while cancelled(server) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cancelled(server) == before + 1


# ------------------------------------------------------------------ errors
def test_error_bodies(oai, model_dir):
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="no-such-model", prompt=PROMPT_IDS)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model_dir.name, prompt=[1, 10 ** 6], max_tokens=2)
    assert e.value.body["code"] == Code.TOKEN_OUT_OF_VOCAB
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=10 ** 6, stream=True)
    assert e.value.body["code"] == Code.BAD_MAX_NEW_TOKENS  # refused before the stream starts
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, n=0)
    assert e.value.body["code"] == Code.BAD_FIELD and e.value.body["param"] == "n"


def test_priority_is_taken_and_checked(server, oai, model_dir):
    """vLLM's `priority` field (lower first) on both routes and the wire; out of range or not an integer: 400
    bad_field naming it (the wire: `bad_field`)."""
    want = hf_greedy(model_dir, [PROMPT_IDS], NEW)[0]
    out = oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=NEW, temperature=0,
                                 extra_body={"priority": -3})
    assert out.choices[0].finish_reason == "length"
    body = {"model": model_dir.name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    status, _ = http(server, "POST", "/v1/chat/completions", body | {"priority": 7})
    assert status == 200
    for route, base in (("/v1/completions", {"model": model_dir.name, "prompt": PROMPT_IDS, "max_tokens": 2}),
                        ("/v1/chat/completions", body)):
        for bad in (1 << 31, -(1 << 31) - 1, "high", 1.5):
            status, err = http(server, "POST", route, base | {"priority": bad})
            assert status == 400 and err["error"]["code"] == Code.BAD_FIELD, (route, bad, err)
            assert err["error"]["param"] == "priority", err
    with Client(server.address, timeout=60) as c:
        assert c.generate(PROMPT_IDS, max_new_tokens=NEW, priority=2).generated_tokens == want
        for bad in (1 << 40, "high", True):
            with pytest.raises(ClientError) as e:
                c.submit(PROMPT_IDS, max_new_tokens=2, priority=bad)
            assert e.value.code == Code.BAD_FIELD and "priority" in e.value.message, (bad, e.value.message)


# ------------------------------------------------------------------ metrics
def test_metrics_move(server, oai, model_dir):
    before = metrics(server)
    oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=5, temperature=0)
    after = metrics(server)
    assert after["lockstep:generation_tokens_total{}"] - before["lockstep:generation_tokens_total{}"] == 5
    assert after["lockstep:prompt_tokens_total{}"] - before["lockstep:prompt_tokens_total{}"] == len(PROMPT_IDS)
    assert (after["lockstep:request_success_total{finished_reason=length}"]
            - before["lockstep:request_success_total{finished_reason=length}"]) == 1
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"lockstep:{h}_count{{}}"] - before[f"lockstep:{h}_count{{}}"] == 1
        assert after[f"lockstep:{h}_bucket{{le=+Inf}}"] == after[f"lockstep:{h}_count{{}}"]
    assert after["lockstep:inter_token_latency_seconds_count{}"] - before["lockstep:inter_token_latency_seconds_count{}"] == 4
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc",
                  "weight_version", "restart_count"):
        assert f"lockstep:{gauge}{{}}" in after
    for counter in ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total"):
        assert f"lockstep:{counter}{{}}" in after


# ------------------------------------------------------------------ admin
def test_admin_routes_need_the_token(server, model_dir):
    assert http(server, "POST", "/pause")[0] == 401
    assert http(server, "POST", "/pause", token="wrong")[0] == 401
    assert http(server, "GET", "/weight_version")[0] == 401
    status, body = http(server, "GET", "/weight_version", token=TOKEN)
    assert status == 200
    version = body["weight_version"]
    assert http(server, "POST", "/pause", token=TOKEN) == (200, {"paused": True, "mode": "keep"})
    assert http(server, "POST", "/resume", token=TOKEN) == (200, {"paused": False})
    status, result = http(server, "POST", "/update_weights", {"path": str(model_dir), "kv_policy": "keep"}, TOKEN)
    assert status == 200 and result["ok"] and result["version"] == version + 1
    assert http(server, "GET", "/weight_version", token=TOKEN)[1]["weight_version"] == version + 1
    assert metrics(server)["lockstep:weight_version{}"] == version + 1
    status, body = http(server, "POST", "/update_weights", {"path": "/no/such/dir"}, TOKEN)
    assert status == 400 and body["error"]["code"] == Code.WEIGHT_UPDATE_FAILED


def test_separate_gateway_without_token_refuses_admin(server, model_dir):
    """A gateway of its own (as `lockstep http` runs it) on the same driver: it serves, and with no token
    configured refuses the admin routes to everyone."""
    port = free_port()
    gateway = Gateway(server.address, f"127.0.0.1:{port}", settings_for(None, None, {})).start_thread()
    try:
        class Other:
            http = f"http://127.0.0.1:{port}"
        assert http(Other, "POST", "/pause", token=TOKEN)[0] == 403
        status, body = http(Other, "GET", "/v1/models")
        assert status == 200 and body["data"][0]["id"] == model_dir.name  # learnt from the server's health
        status, body = http(Other, "POST", "/v1/completions", {"model": model_dir.name, "prompt": PROMPT_IDS,
                                                               "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
    finally:
        gateway.stop()


# ------------------------------------------------------------------ the gateway as rank 0's child process
def gateway_pids(listen: str) -> list[int]:
    """The pids of `lockstep http` processes listening on `listen` (their command lines, from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if b"http" in argv and listen.encode() in argv and b"--exit-with-parent" in argv:
                found.append(int(entry))
    return found


def test_a_killed_gateway_process_comes_back(server, model_dir):
    """`lockstep serve --http` runs the gateway as a child of rank 0; killed outright, it is started again and
    serves the same address (this test runs last in the module: the gateway is briefly away)."""
    listen = server.http.removeprefix("http://")
    (pid,) = gateway_pids(listen)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            status, body = http(server, "POST", "/v1/completions", {"model": model_dir.name, "prompt": PROMPT_IDS,
                                                                    "max_tokens": 2})
            if status == 200:
                break
        except OSError:  # not listening yet
            pass
        time.sleep(0.3)
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert gateway_pids(listen) not in ([], [pid])


def test_the_gateway_process_leaves_with_its_parent(model_dir):
    """`--exit-with-parent`: a gateway whose parent is killed outright stops and lets its port go."""
    port = free_port()
    script = (f"{sys.executable} -m launch.cli http --address tcp://127.0.0.1:{free_port()} --listen "
              f"127.0.0.1:{port} --model {model_dir} --exit-with-parent $$ & echo child $!; wait")
    parent = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True,
                              env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    child = int(parent.stdout.readline().split()[1])
    try:
        assert any(line.startswith("http http") for line in parent.stdout), "the gateway did not start"
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and os.path.exists(f"/proc/{child}"):
            with open(f"/proc/{child}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":  # a zombie: it has exited
                    break
            time.sleep(0.1)
        else:
            assert not os.path.exists(f"/proc/{child}"), "the gateway outlived its parent"
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # the port is free again
    finally:
        try:
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_gateway_on_a_taken_address_says_so(model_dir):
    """`lockstep http` on an address in use exits 1 with one line that says so (not uvicorn's traceback), and
    rank 0's GatewayProcess refuses at once, naming the address."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        done = subprocess.run([sys.executable, "-m", "launch.cli", "http", "--address", "tcp://127.0.0.1:1",
                               "--listen", listen, "--model", str(model_dir)], capture_output=True, text=True,
                              timeout=120, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert f"cannot listen on http://{listen}" in done.stderr
        with pytest.raises(RuntimeError, match=f"cannot listen on {listen}: the address is in use"):
            GatewayProcess("tcp://127.0.0.1:1", listen, str(model_dir), None).start()


def test_release_and_resume_memory_over_http(server, model_dir):
    """Refused unpaused; freed on both ranks; resume refused until an update; then transformers' tokens."""
    status, body = http(server, "POST", "/release_memory", {"tags": ["kv_cache"]}, TOKEN)
    assert status == 409 and body["error"]["code"] == Code.NOT_PAUSED
    assert http(server, "POST", "/release_memory", {"tags": ["cpu"]}, TOKEN)[0] == 400
    try:
        assert http(server, "POST", "/pause", token=TOKEN) == (200, {"paused": True, "mode": "keep"})
        status, r = http(server, "POST", "/release_memory", {"keep_weights_on_host": False}, TOKEN)
        assert status == 200 and r["released"] == ["kv_cache", "weights"] and [f["rank"] for f in r["ranks"]] == [0, 1]
        assert all(f["freed"] >= 0.8 * (f["kv_cache_bytes"] + f["weights_bytes"]) for f in r["ranks"]), r
        with Client(server.address) as c:
            rid = c.submit(PROMPT_IDS, max_new_tokens=NEW)  # queued: nothing steps while memory is released
            status, body = http(server, "POST", "/resume_memory", None, TOKEN)
            assert status == 409 and body["error"]["code"] == Code.WEIGHTS_NOT_RESTORED
            assert http(server, "POST", "/update_weights", {"path": str(model_dir)}, TOKEN)[1]["ok"]
            assert c.resume_memory()["released"] == []
            assert http(server, "POST", "/resume", token=TOKEN)[1]["paused"] is False
            assert c.result(rid, timeout=120).generated_tokens == hf_greedy(model_dir, [PROMPT_IDS], NEW)[0]
    finally:  # the module's other tests share this server
        for path, body in (("/update_weights", {"path": str(model_dir)}), ("/resume_memory", None), ("/resume", None)):
            http(server, "POST", path, body, TOKEN)
