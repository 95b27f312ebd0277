"""TRL's vllm-serve routes (launch/gateway/trl_routes.py) on the gateway app in this process, over a stand-in for
the driver's AsyncClient: a TRL-shaped client's calls (health, world size, generate with n=4, chat, sequence
logprobs, the weight routes) and the admin trust (a loopback caller with http_admin_trust = "loopback" reaches TRL's,
SGLang's and the gateway's own admin routes without a token; others do not). tests/test_http_trl.py runs the same
calls against the shared TP=2 server."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient

from cluster.http_config import admin_trust_networks
from cluster.outputs import GenerationOutput, RequestStatus
from cluster.samples import sample_ids
from launch.gateway.admin_auth import AdminAuth
from launch.gateway.app import make_app
from launch.gateway.openai_serving import Model


class FakeTokenizer:
    eos_token_id = 2
    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kw):
        return "".join(m["content"] for m in messages) + ("!" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


class FakeDriver:
    """AsyncClient's calls, answered in this process: sample j of a prompt (0: the request, i + 1: its child i)
    generates [first prompt token * 10 + j] * max_new_tokens; each call's keywords are kept in `calls`."""

    def __init__(self):
        self.calls: list[dict] = []
        self.paused = False

    async def generate(self, input_ids=None, *, text=None, request_id, n=1, **params):
        self.calls.append(params | {"n": n, "text": text, "input_ids": input_ids})
        prompt = list(input_ids) if input_ids is not None else [ord(c) for c in text]
        outs = []
        for rid in sample_ids(request_id, n):
            j = 0 if rid == request_id else int(rid.rsplit("#", 1)[1]) + 1
            tokens = [prompt[0] * 10 + j] * params["max_new_tokens"]
            top = [[(7, -0.1)]] * len(tokens) if params.get("top_logprobs") else None
            scores = {}
            if params.get("prompt_logprobs") is not None:
                scores = {"prompt_logprobs": [None] + [-1.0] * (len(prompt) - 1),
                          "prompt_top_logprobs": [()] + [[(7, -0.5)]] * (len(prompt) - 1)}
            outs.append(GenerationOutput(rid, prompt_ids=prompt, generated_tokens=tokens, logprobs=[-0.2] * len(tokens),
                                         top_logprobs=top, status=RequestStatus.FINISHED, **scores))
        return outs if n > 1 else outs[0]

    async def health(self):
        return {"ok": True, "world_size": 2, "weights": {"version": 0}}

    async def pause(self, mode="keep"):
        self.paused = True

    async def cancel(self, request_id):
        pass


@pytest.fixture
def driver():
    return FakeDriver()


def gateway(driver, host: str = "127.0.0.1", trust: str | None = None) -> TestClient:
    auth = AdminAuth.of("secret", admin_trust_networks(trust))
    app = make_app(driver, Model("tiny", "/models/tiny", FakeTokenizer()), auth)
    return TestClient(app, client=(host, 40000))


def test_a_trl_client_generates_n_contiguous_completions_with_logprobs(driver):
    http = gateway(driver)
    assert http.get("/health/").json() == {"status": "ok"}
    assert http.get("/get_world_size/").json() == {"world_size": 2}
    body = {"prompts": [[3, 4], [5, 6, 7]], "images": None, "n": 4, "repetition_penalty": 1.0, "temperature": 1.0,
            "top_p": 1.0, "top_k": 0, "min_p": 0.0, "max_tokens": 2, "logprobs": 1,
            "structured_outputs_regex": None, "generation_kwargs": {"seed": 11}}  # what VLLMClient.generate sends
    got = http.post("/generate/", json=body).json()
    assert got["prompt_ids"] == [[3, 4], [5, 6, 7]]
    assert got["completion_ids"] == [[30 + j] * 2 for j in range(4)] + [[50 + j] * 2 for j in range(4)]
    assert got["logprobs"][0] == [[-0.1, -0.2]] * 2 and got["logprob_token_ids"][5] == [[7, 51]] * 2
    assert [c["n"] for c in driver.calls] == [4, 4] and driver.calls[0]["seed"] == 11
    assert driver.calls[0]["logprobs_mode"] == "processed_logprobs" and driver.calls[0]["top_logprobs"] == 1
    text = http.post("/generate/", json={"prompts": ["ab"], "logprobs": None}).json()
    assert text["completion_ids"] == [[970] * 16] and text["logprobs"] is None and driver.calls[-1]["text"] == "ab"
    chat = http.post("/chat/", json={"messages": [[{"role": "user", "content": "hi"}]], "n": 2, "max_tokens": 1})
    assert chat.json()["prompt_ids"] == [[ord("h"), ord("i"), ord("!")]]
    refused = http.post("/generate/", json={"prompts": ["a"], "generation_kwargs": {"logits_processors": []}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "generation_kwargs.logits_processors"


def test_sequence_logprobs_json_and_binary(driver):
    http = gateway(driver)
    body = {"sequences": [[3, 4, 5]], "prompt_lengths": [1], "top_logprobs": 1, "temperature": 1.0}
    got = http.post("/get_sequence_logprobs/", json=body | {"response_format": "json"}).json()
    assert got["logprobs"] == [[[-0.5, -1.0], [-0.5, -1.0]]] and got["logprob_token_ids"] == [[[7, 4], [7, 5]]]
    assert driver.calls[-1]["prompt_logprobs"] == 1 and driver.calls[-1]["max_new_tokens"] == 1
    binary = http.post("/get_sequence_logprobs/", json=body | {"response_format": "binary"}).json()
    actual = np.frombuffer(base64.b64decode(binary["actual_logprobs_b64"]), dtype=np.float32)
    assert binary["shape"] == [1, 2, 1] and actual.tolist() == [-1.0, -1.0]
    assert http.post("/get_sequence_logprobs/", json=body | {"top_logprobs": 100}).status_code == 400


def test_weight_routes_answer_why_and_admin_trust(driver):
    http = gateway(driver)
    for route in ("/init_communicator/", "/update_named_param/"):
        r = http.post(route, json={"host": "0.0.0.0", "port": 51216, "world_size": 3, "client_device_uuid": "x"})
        assert r.status_code == 501 and r.json()["error"]["code"] == "vllm_communicator_unsupported"
        assert "PyNcclCommunicator" in r.json()["error"]["message"]
    assert http.post("/close_communicator/").status_code == 200
    assert http.post("/reset_prefix_cache/").status_code == 401  # no trust: the token
    assert http.post("/reset_prefix_cache/", headers={"Authorization": "Bearer secret"}).status_code == 200

    trusted = gateway(driver, "127.0.0.1", trust="loopback")
    assert trusted.post("/reset_prefix_cache/").status_code == 200
    assert trusted.post("/pause_generation", json={}).status_code == 200 and driver.paused  # SGLang's
    assert trusted.post("/pause", json={}).status_code == 200  # the gateway's own
    remote = gateway(driver, "10.1.1.1", trust="loopback")
    assert remote.post("/reset_prefix_cache/").status_code == 401
    assert remote.post("/pause_generation", json={}).status_code == 401
