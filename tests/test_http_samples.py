"""n samples of one prompt on the wire (`n` in a submit, Client) and over HTTP (OpenAI's `n`), against the TP=2
server tests/test_http.py shares: the samples' ids and order, one prefill a group (the server's stats), seeded
repeats, greedy samples equal to transformers', a cancel of the request's id ending every sample, and OpenAI
choices 0..n-1 whether streamed or not."""

from __future__ import annotations

import asyncio

import pytest

from cluster.client import AsyncClient, Client
from cluster.outputs import RequestStatus
from cluster.samples import sample_ids
from tests.conftest import hf_greedy
from tests import test_http
from tests.test_http import PROMPT_IDS

pytestmark = pytest.mark.slow  # the shared TP=2 server
server, model_dir, oai = test_http.server, test_http.model_dir, test_http.oai  # the shared server's fixtures

SAMPLED = dict(do_sample=True, temperature=1.0, seed=5, max_new_tokens=8, eos_token_id=-1)


def fork_stats(c: Client) -> tuple[int, int]:
    s = c.stats()
    return s["forked_children"], s["prompt_tokens_computed"]


def test_wire_n_samples_one_prefill_seeded_and_greedy(server, model_dir):
    with Client(server.address, timeout=120) as c:
        before = fork_stats(c)
        outs = c.generate(PROMPT_IDS, n=4, request_id="grpo-1", **SAMPLED)
        after = fork_stats(c)
        assert [o.request_id for o in outs] == sample_ids("grpo-1", 4) == [
            "grpo-1__child#0", "grpo-1__child#1", "grpo-1__child#2", "grpo-1"]
        assert all(o.status == RequestStatus.FINISHED and len(o.generated_tokens) == 8 for o in outs)
        assert len({tuple(o.generated_tokens) for o in outs}) == 4  # distinct samples
        # one prefill: the prompt once, then each child's last prompt token
        assert (after[0] - before[0], after[1] - before[1]) == (3, len(PROMPT_IDS) + 3)
        again = c.generate(PROMPT_IDS, n=4, request_id="grpo-2", **SAMPLED)
        assert [o.generated_tokens for o in again] == [o.generated_tokens for o in outs]  # the seed repeats them
        one = c.generate(PROMPT_IDS, **SAMPLED)  # n = 1, the same seed: the request itself, alone
        assert one.generated_tokens == outs[-1].generated_tokens
        greedy = c.generate(PROMPT_IDS, n=3, max_new_tokens=8, eos_token_id=-1, do_sample=False)
        assert [o.generated_tokens for o in greedy] == hf_greedy(model_dir, [PROMPT_IDS], 8) * 3


def test_cancelling_the_request_id_ends_every_sample(server):
    with Client(server.address, timeout=120) as c:
        rid = c.submit(PROMPT_IDS, n=3, max_new_tokens=400, eos_token_id=-1)
        c.cancel(rid)
        finals = [c.result(i) for i in sample_ids(rid, 3)]
        assert all(o.status == RequestStatus.CANCELLED for o in finals), [o.status for o in finals]
        assert c.stats()["running"] == 0


def test_async_stream_of_n_samples_ends_with_every_final(server):
    async def run() -> dict[str, list[int]]:
        client = AsyncClient(server.address, timeout=120)
        finals: dict[str, list[int]] = {}
        async for out in client.stream(PROMPT_IDS, n=3, request_id="s-1", **SAMPLED):
            if out.is_finished():
                finals[out.request_id] = out.generated_tokens
        await client.close()
        return finals

    finals = asyncio.run(run())
    with Client(server.address, timeout=120) as c:
        whole = c.generate(PROMPT_IDS, n=3, request_id="s-2", **SAMPLED)
    assert [finals[i] for i in sample_ids("s-1", 3)] == [o.generated_tokens for o in whole]


def test_openai_n_is_one_submit_with_choices_0_to_n_minus_1(server, oai, model_dir):
    def call(n: int, stream: bool = False):
        return oai.completions.create(model=model_dir.name, prompt=PROMPT_IDS, max_tokens=6, n=n, temperature=1.0,
                                      seed=11, logprobs=0, stream=stream)

    with Client(server.address, timeout=120) as c:
        before = fork_stats(c)
        r = call(4)
        after = fork_stats(c)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    tokens = [ch.logprobs.tokens for ch in r.choices]
    assert len({tuple(t) for t in tokens}) == 4 and r.usage.completion_tokens == 24
    assert (after[0] - before[0], after[1] - before[1]) == (3, len(PROMPT_IDS) + 3)
    assert call(1).choices[0].logprobs.tokens == tokens[0]  # choice 0 is the request itself
    streamed: dict[int, list[str]] = {}
    for chunk in call(4, stream=True):
        for ch in chunk.choices:
            streamed.setdefault(ch.index, []).extend(ch.logprobs.tokens if ch.logprobs else [])
    assert [streamed[i] for i in range(4)] == tokens
    chat = oai.chat.completions.create(model=model_dir.name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, n=2, temperature=1.0, seed=3)
    assert [ch.index for ch in chat.choices] == [0, 1]
