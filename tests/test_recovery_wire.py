"""Resume over the wire at TP=2 (`lockstep serve`): a submit with `resume_tokens` continues token-exactly, its
stream goes on at the next index, a bad resume is refused with its code; and the client's typed error when
a lost request cannot be resumed (no server in time, max_resumes, resume=False)."""

from __future__ import annotations

import time

import pytest

from cluster.client.client import Client, ClientError, RequestLost
from launch.torchrun import free_port
from tests.serving import fast_config, serve

SAMPLED = {"do_sample": True, "temperature": 0.9, "top_k": 50, "seed": 77}


@pytest.fixture(scope="module")
def client(make_checkpoint):
    with serve(make_checkpoint("llama"), tp=2, config=fast_config()) as s:
        with Client(s.address, timeout=120) as c:
            yield c


@pytest.mark.slow
@pytest.mark.parametrize("params", [{}, SAMPLED], ids=["greedy", "seeded"])
def test_resume_over_the_wire_continues_exactly(client, params):
    prompt = [1, 40, 41, 42]
    whole = client.generate(prompt, request_id=f"w{bool(params)}", max_new_tokens=12, eos_token_id=-1, **params)
    for k in (0, 3, 11):
        got = list(whole.generated_tokens[:k])
        indices = []
        for out in client.stream(prompt, request_id=f"w{bool(params)}", max_new_tokens=12, eos_token_id=-1,
                                 resume_tokens=whole.generated_tokens[:k], resume_versions=[(0, 0)] if k else [],
                                 resumes=1, **params):
            indices.append(len(out.generated_tokens))
            assert out.generated_tokens[:len(got)] == got  # cumulative: what came before never changes
            got = out.generated_tokens
        assert indices == list(range(k + 1, 13)), indices  # one token at a time from k on: none twice, none lost
        assert got == whole.generated_tokens and out.resumes == 1 and out.weight_versions == [(0, 0)]


@pytest.mark.slow
def test_bad_resume_is_refused_with_its_code(client):
    with pytest.raises(ClientError) as e:
        client.submit([1, 2, 3], max_new_tokens=4, resume_tokens=[5, 6, 7, 8])
    assert e.value.code == "bad_field" and "at least one token" in e.value.message
    with pytest.raises(ClientError) as e:
        client.submit([1, 2, 3], max_new_tokens=4, resume_tokens=[5, 10 ** 9])
    assert e.value.code == "token_out_of_vocab"


@pytest.mark.slow
def test_no_server_within_the_bound_is_a_typed_error():
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    with Client(address, server_timeout_s=1.0, resume_timeout_s=3.0) as c:
        t0 = time.monotonic()
        rid = c.submit([1, 2, 3], max_new_tokens=4)  # taken: the client resubmits it once a server answers
        with pytest.raises(RequestLost) as e:
            c.result(rid, timeout=30)
    assert e.value.code == "server_gone" and e.value.reason == RequestLost.NO_SERVER
    assert e.value.tokens_delivered == 0 and "within resume_timeout_s=3" in e.value.message
    assert 3.0 <= time.monotonic() - t0 < 10.0


@pytest.mark.parametrize("kwargs, reason", [({"resume": False}, RequestLost.RESUME_OFF),
                                            ({"max_resumes": 0}, RequestLost.MAX_RESUMES)])
def test_a_request_not_resumed_says_why(kwargs, reason):
    address = f"tcp://127.0.0.1:{free_port()}"
    with Client(address, server_timeout_s=1.0, **kwargs) as c:
        with pytest.raises(RequestLost) as e:
            c.generate([1, 2, 3], max_new_tokens=4)
    assert e.value.reason == reason and e.value.code == "server_gone" and f"not resumed: {reason}" in str(e.value)


@pytest.mark.slow
def test_closing_the_client_ends_a_waiting_resume():
    address = f"tcp://127.0.0.1:{free_port()}"
    c = Client(address, server_timeout_s=1.0, resume_timeout_s=60.0)
    rid = c.submit([1, 2, 3], max_new_tokens=4)
    req = c._collect(rid)
    time.sleep(2.0)  # the server is taken as gone; the request waits for its resume
    c.close()
    with pytest.raises(RequestLost) as e:
        req.final.result(5)
    assert e.value.reason == RequestLost.CLIENT_CLOSED
