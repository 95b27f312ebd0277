"""Hostile sampling values, per-request sampling failures and requests too big for the cache, against real
`lockstep serve` processes at TP=2. Every hostile value is answered with `bad_field` naming the parameter and the
server goes on serving transformers' tokens; a sampling error fails only its own request (`sampling_failed`);
sampling parameters sent to a server that would ignore them are refused (`unsupported`)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.client.client import Client, ClientError
from cluster.outputs import RequestStatus
from tests.conftest import hf_greedy
from tests.serving import serve
from tests.workloads import mixed_prompts

PRESET = """
[continuous_batching]
page_size = 16
num_blocks = 24
max_batch_tokens = 128
max_requests_per_batch = 16
cpu_group_timeout = 5.0
per_request_processors = {prp}

[serve]
client_timeout_s = 10.0
"""
DOOMED = "doomed"  # the request id whose sampling the server's LOCKSTEP_FAULTS makes fail
PROMPTS = mixed_prompts(2048)[:6]
NEW = 8


@pytest.fixture(scope="module")
def server(make_checkpoint):
    """per_request_processors = true, and a sampling fault armed for request `doomed` (only)."""
    old = os.environ.get("LOCKSTEP_FAULTS")
    os.environ["LOCKSTEP_FAULTS"] = f"sample:request={DOOMED}"
    try:
        with serve(make_checkpoint("llama"), tp=2, config=PRESET.format(prp="true"), forked=True) as s:
            yield s
    finally:
        if old is None:
            os.environ.pop("LOCKSTEP_FAULTS", None)
        else:
            os.environ["LOCKSTEP_FAULTS"] = old


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=60) as c:
        yield c


def greedy_matches_transformers(c: Client, model_dir) -> None:
    rids = [c.submit(p, max_new_tokens=NEW) for p in PROMPTS]
    assert [c.result(r, timeout=60).generated_tokens for r in rids] == hf_greedy(model_dir, PROMPTS, NEW)


HOSTILE = [
    ("top_k", dict(top_k=-2)), ("top_p", dict(top_p=0.0)), ("top_p", dict(top_p=1.5)),
    ("temperature", dict(temperature=float("nan"))), ("temperature", dict(temperature=-1.0)),
    ("temperature", dict(temperature=float("inf"))), ("temperature", dict(temperature=0.0)),
    ("repetition_penalty", dict(repetition_penalty=0.0)), ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("repetition_penalty", dict(repetition_penalty=float("nan"))),
    # 2**70 cannot be written in msgpack at all (test_validation covers it through the manager API): 2**63 and
    # 2**64 - 1 are past int64 and still encodable
    ("seed", dict(seed=2 ** 64 - 1)), ("seed", dict(seed=2 ** 63)),
    ("eos_token_id", dict(eos_token_id=list(range(1000)))), ("eos_token_id", dict(eos_token_id=[1, 2048])),
    ("request_id", dict(request_id="x" * 10_000)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,params", HOSTILE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(HOSTILE)])
def test_hostile_values_are_bad_field(client, name, params):
    with pytest.raises(ClientError) as e:
        client.submit(PROMPTS[0], max_new_tokens=4, do_sample=True, **params)
    assert e.value.code == "bad_field", e.value
    assert name in e.value.message and len(e.value.message) < 300


@pytest.mark.slow
def test_top_k_minus_one_is_accepted_and_means_no_top_k(client):
    def sampled(**top_k):  # the same id and seed: the same random stream, whatever else runs
        return client.generate(PROMPTS[1], request_id="same", max_new_tokens=NEW, do_sample=True, seed=11,
                               **top_k).generated_tokens

    off = sampled(top_k=0)
    assert sampled(top_k=-1) == off == sampled()
    assert len(off) == NEW


@pytest.mark.slow
def test_server_keeps_serving_after_hostile_values(server, client, make_checkpoint):
    greedy_matches_transformers(client, make_checkpoint("llama"))
    assert client.health()["ok"]
    assert "driver loop failed" not in server.log


@pytest.mark.slow
def test_request_larger_than_the_cache_is_refused_at_submit(client, make_checkpoint):
    # 24 pages of 16 tokens: a prompt of 300 and 100 new tokens need the K/V of 399 tokens, 25 pages
    with pytest.raises(ClientError) as e:
        client.submit(mixed_prompts(2048)[15], max_new_tokens=100)
    assert e.value.code == "exceeds_kv_cache", e.value
    assert client.stats()["waiting"] == 0
    greedy_matches_transformers(client, make_checkpoint("llama"))


@pytest.mark.slow
def test_sampling_fault_fails_only_its_own_request(server, client, make_checkpoint):
    with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:  # submitted together, so they share steps
        doomed = pool.submit(client.generate, PROMPTS[2], request_id=DOOMED, max_new_tokens=NEW)
        others = [pool.submit(client.generate, p, max_new_tokens=NEW) for p in PROMPTS]
        outs = [f.result(timeout=60) for f in others]
        with pytest.raises(ClientError) as e:
            doomed.result(timeout=60)
    assert e.value.code == "sampling_failed", e.value
    assert "injected fault" in e.value.message
    assert all(o.status == RequestStatus.FINISHED for o in outs)
    assert [o.generated_tokens for o in outs] == hf_greedy(make_checkpoint("llama"), PROMPTS, NEW)
    greedy_matches_transformers(client, make_checkpoint("llama"))  # and the loop lives on
    assert client.health()["ok"]


@pytest.mark.slow
def test_sampling_parameters_are_refused_where_they_would_be_ignored(make_checkpoint):
    model_dir = make_checkpoint("llama")
    with serve(model_dir, tp=2, config=PRESET.format(prp="false"), forked=True) as s, \
            Client(s.address, timeout=60) as c:
        for params in (dict(do_sample=True, top_k=5), dict(temperature=0.7, do_sample=True), dict(top_p=0.9)):
            with pytest.raises(ClientError) as e:
                c.submit(PROMPTS[0], max_new_tokens=4, **params)
            assert e.value.code == "unsupported", e.value
            assert "per_request_processors" in e.value.message
        with pytest.raises(ClientError) as e:  # a bad value is still a bad value
            c.submit(PROMPTS[0], max_new_tokens=4, top_p=1.5)
        assert e.value.code == "bad_field"
        greedy_matches_transformers(c, model_dir)
