"""A TRL-shaped client (the bodies TRL 1.10's VLLMClient sends, its answers read as it reads them) against the TP=2
server tests/test_http.py shares: health and world size, generate with n=4 (each prompt's four completions next to
each other, prompts in order: the samples the wire's n=4 submit gives, the request's own first), greedy completions
equal to transformers', and get_sequence_logprobs (json and binary) equal to transformers' log-softmax. The shaping
is tested in process by tests/test_trl_shape.py and tests/test_trl_gateway.py."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from cluster.client import Client
from tests import test_http
from tests.conftest import hf_greedy
from tests.test_http import PROMPT_IDS, http

pytestmark = pytest.mark.slow  # the shared TP=2 server
server, model_dir = test_http.server, test_http.model_dir  # the shared server's fixtures

OTHER = [1, 5, 9, 300]


def trl_generate(server, prompts, **fields) -> dict:
    """VLLMClient.generate's body, TRL's defaults, `fields` over them."""
    body = {"prompts": prompts, "images": None, "n": 1, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0,
            "top_k": 0, "min_p": 0.0, "max_tokens": 16, "logprobs": 0, "structured_outputs_regex": None,
            "generation_kwargs": {}} | fields
    status, got = http(server, "POST", "/generate/", body)
    assert status == 200, got
    return got


def test_generate_n4_contiguous_in_prompt_order(server, model_dir):
    assert http(server, "GET", "/health/") == (200, {"status": "ok"})
    assert http(server, "GET", "/get_world_size/") == (200, {"world_size": 2})
    got = trl_generate(server, [PROMPT_IDS, OTHER], n=4, max_tokens=6, generation_kwargs={"seed": 7})
    assert got["prompt_ids"] == [PROMPT_IDS, OTHER] and len(got["completion_ids"]) == 8
    with Client(server.address, timeout=120) as c:
        for p, prompt in enumerate((PROMPT_IDS, OTHER)):
            outs = c.generate(prompt, n=4, do_sample=True, temperature=1.0, seed=7, max_new_tokens=6, logprobs=True)
            want = [outs[-1], *outs[:-1]]  # the request itself, then its children
            assert got["completion_ids"][4 * p:4 * p + 4] == [o.generated_tokens for o in want]
            for lps, ids, o in zip(got["logprobs"][4 * p:], got["logprob_token_ids"][4 * p:], want):
                assert [i for (i,) in ids] == o.generated_tokens
                assert [lp for (lp,) in lps] == pytest.approx(o.logprobs, abs=1e-5)
    assert len({tuple(c) for c in got["completion_ids"][:4]}) > 1  # four samples, not one four times
    greedy = trl_generate(server, [PROMPT_IDS], n=2, temperature=0.0, max_tokens=8, logprobs=None,
                          generation_kwargs={"ignore_eos": True})
    assert greedy["completion_ids"] == hf_greedy(model_dir, [PROMPT_IDS], 8) * 2 and greedy["logprobs"] is None


def test_sequence_logprobs_equal_transformers(server, model_dir):
    from transformers import AutoModelForCausalLM

    completion = hf_greedy(model_dir, [PROMPT_IDS], 8)[0]
    sequence = PROMPT_IDS + completion
    body = {"sequences": [sequence, OTHER], "prompt_lengths": [len(PROMPT_IDS), 1], "top_logprobs": 2,
            "temperature": 1.0}
    status, plain = http(server, "POST", "/get_sequence_logprobs/", body | {"response_format": "json"})
    assert status == 200, plain
    status, packed = http(server, "POST", "/get_sequence_logprobs/", body | {"response_format": "binary"})
    assert status == 200 and packed["shape"] == [2, 8, 2] and packed["completion_lengths"] == [8, 3]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        scores = hf(torch.tensor([sequence])).logits[0, len(PROMPT_IDS) - 1:-1].log_softmax(-1)
    want = scores.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()
    top = scores.topk(2)
    actual = np.frombuffer(base64.b64decode(packed["actual_logprobs_b64"]), dtype=np.float32).reshape(2, 8)
    top_ids = np.frombuffer(base64.b64decode(packed["token_ids_b64"]), dtype=np.int32).reshape(2, 8, 2)
    assert actual[0].tolist() == pytest.approx(want, abs=1e-4)
    assert top_ids[0].tolist() == top.indices.tolist()
    for t, (lps, ids) in enumerate(zip(plain["logprobs"][0], plain["logprob_token_ids"][0])):
        assert ids[:2] == top.indices[t].tolist() and lps[:2] == pytest.approx(top.values[t].tolist(), abs=1e-4)
        assert completion[t] in ids  # greedy: the argmax, so the top two hold it and nothing is appended
    assert len(plain["logprobs"][1]) == 3
