"""One rank of the sampling tests at TP=2: `sampling_rank.py MODE[,MODE...] DIR OUT`. Every rank runs the same
modes, in order; each rank writes its record (mode -> what the mode returns) to OUT.rank<r>.

- `logprobs DIR OUT`: greedy generate_batch with return_logprobs; rank 0 records tokens and logprobs.
- `mixed DIR OUT`: the seeded requests of MIXED (one target and seven others, each with its own sampling
  parameters) through one manager; rank 0 records each request's tokens (`mixed_requests` also runs in-process).
- `publish DIR OUT`: outputs owed to a worker that reads results must reach it even when a step's batch holds
  only a request that can never fit the cache (that step runs no forward). Rank 0 queues a short request and,
  straight after it, a request larger than the whole cache (put in the inbox by hand, past the add-time check
  that would refuse it); rank 1 records every final output it receives.
"""

from __future__ import annotations

import json
import sys
import time

import cluster
from driver.engine.request import Request
from tests.workloads import mixed_prompts

CFG = dict(page_size=16, max_batch_tokens=64, num_blocks=8)
# request id -> sampling parameters; "target" is the request whose tokens must not depend on its company
MIXED = {
    "target": {"do_sample": True, "temperature": 0.9, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1, "seed": 11},
    "other_0": {"do_sample": False},
    "other_1": {"do_sample": True, "temperature": 1.3, "seed": 5},
    "other_2": {"do_sample": True, "temperature": 0.6, "top_k": 5},
    "other_3": {"do_sample": True, "top_p": 0.5, "seed": 7},
    "other_4": {"do_sample": False, "repetition_penalty": 1.5},
    "other_5": {"do_sample": True, "temperature": 0.8, "top_k": -1, "top_p": 0.95, "repetition_penalty": 0.9,
                "seed": 123},
    "other_6": {"do_sample": True, "temperature": 1.0, "top_k": 1},
}
MIXED_NEW_TOKENS = 12


def mixed_requests(model, ids: list[str]) -> dict[str, list[int]]:
    """Every rank calls it: the requests `ids` of MIXED (prompts from mixed_prompts, config seed 2024), served
    together by one manager; request id -> generated tokens."""
    prompts = mixed_prompts(model.config.vocab_size)[:len(MIXED)]
    m = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(
        page_size=16, seed=2024, per_request_processors=True))
    m.wants_results = True  # before start: every final reaches every rank
    m.start()
    for i, rid in enumerate(MIXED):
        if rid in ids:
            m.add_request(prompts[i], request_id=rid, max_new_tokens=MIXED_NEW_TOKENS, eos_token_id=-1, **MIXED[rid])
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + 120
    while len(tokens) < len(ids) and time.monotonic() < deadline:
        out = m.get_result(timeout=0.5)
        if out is None and not m.is_running():
            break
        if out is not None and out.is_finished():
            assert out.error is None, out.error
            tokens[out.request_id] = out.generated_tokens
    m.stop()
    m.destroy()
    return tokens


def mixed(model) -> dict:
    return {"tokens": mixed_requests(model, list(MIXED))}


def logprobs(model) -> dict:
    prompts = mixed_prompts(model.config.vocab_size)[:6]
    out = model.generate_batch(prompts, max_new_tokens=8, continuous_batching_config=cluster.ContinuousBatchingConfig(
        page_size=16, return_logprobs=True))
    return {"prompts": prompts, "tokens": [o.generated_tokens for o in out.values()],
            "logprobs": [o.logprobs for o in out.values()]}


def publish(model) -> dict:
    m = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(**CFG))
    m.wants_results = True  # before start: every final reaches every rank
    m.warmup()
    m.start()
    finals: dict[str, int] = {}
    if m.is_driver:
        m.add_request([5, 6, 7, 8], request_id="short", max_new_tokens=3)
        big = Request(request_id="too_big", prompt_ids=list(range(3, 203)), max_new_tokens=4)  # 13 pages > 8
        m.requests[big.request_id] = big
        m.inbox.put(("add", big))
    deadline = time.monotonic() + 30
    while len(finals) < 2 and time.monotonic() < deadline:
        out = m.get_result(timeout=0.5)
        if out is None and not m.is_running():
            break
        if out is not None and out.is_finished():
            finals[out.request_id] = int(out.status)
    m.stop()
    m.destroy()
    return {"finals": finals}


if __name__ == "__main__":
    modes, model_dir, out_path = sys.argv[1:4]
    model = cluster.load(model_dir)
    runs = {"logprobs": logprobs, "publish": publish, "mixed": mixed}
    record = {mode: runs[mode](model) for mode in modes.split(",")}
    with open(f"{out_path}.rank{model.groups.rank}", "w") as f:
        json.dump(record, f)
