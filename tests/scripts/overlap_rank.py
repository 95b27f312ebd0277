"""One workload through the manager with overlapped scheduling off and on, on every rank: mixed prompt lengths
and max_new_tokens, an EOS list that ends requests mid-batch, seeded sampling and repetition-penalty rows,
streaming, a cancel while steps are in flight, and (overlap only) a pause with a weight reload and a stop
while requests run. Rank 0 returns a record per mode; the test compares them token for token. Run directly
(TP=1) or under torchrun (TP=2):

    overlap_rank.py MODEL_DIR OUT_PREFIX   ->   OUT_PREFIX.rank0 (json)
"""

from __future__ import annotations

import json
import sys

import cluster
from tests.workloads import mixed_prompts
from worker.loader import load_weights

CFG = dict(page_size=16, max_batch_tokens=64, per_request_processors=True, seed=1234)
MAX_NEW = [1, 2, 3, 5, 8, 13, 21, 24]


def workload(model, overlap: bool, model_dir: str) -> dict:
    """Every rank calls it; rank 0's record: tokens, statuses and streams of every request."""
    vocab = model.config.vocab_size
    prompts = mixed_prompts(vocab)
    eos = list(range(7, vocab, vocab // 64 + 1))[:64]  # about 1 token in 33 ends a request
    rec: dict = {}
    config = cluster.ContinuousBatchingConfig(use_async_batching=overlap, **CFG)
    with model.continuous_batching_context_manager(continuous_batching_config=config) as m:
        ids = []
        for i, p in enumerate(prompts[:12]):
            kw: dict = {}
            if i % 3 == 1:
                kw = dict(do_sample=True, temperature=0.9, top_k=40, seed=100 + i)
            elif i % 3 == 2:
                kw = dict(repetition_penalty=1.4, do_sample=i % 2 == 0, seed=200 + i)
            ids.append(m.add_request(p, max_new_tokens=MAX_NEW[i % len(MAX_NEW)], streaming=i == 4,
                                     eos_token_id=eos if i % 2 else None, **kw))
        cid = m.add_request(prompts[12], max_new_tokens=200, streaming=True)
        if m.is_driver:
            first = m.get_result(cid, timeout=120)
            m.cancel_request(cid)
            cancelled = [first] + list(m.request_id_iter(cid))
            rec["cancel"] = {"status": int(cancelled[-1].status), "tokens": cancelled[-1].generated_tokens,
                             "finals": sum(o.is_finished() for o in cancelled)}
            stream = list(m.request_id_iter(ids[4]))
            rec["stream"] = [[len(o.generated_tokens), int(o.status)] for o in stream]
            outs = [stream[-1] if i == ids[4] else m.get_result(i, timeout=120) for i in ids]
            rec["tokens"] = [o.generated_tokens for o in outs]
            rec["status"] = [int(o.status) for o in outs]
            rec["free"] = m.stats()["free_blocks"] == m.stats()["num_blocks"]
        if overlap:  # a pause with a weight reload, then a stop, while requests are in flight
            more = m.add_requests(prompts[13:16], max_new_tokens=12)
            with m.pause():
                load_weights(model.model, model_dir)  # the same weights: the outputs must not change
            if m.is_driver:
                rec["after_pause"] = [m.get_result(i, timeout=120).generated_tokens for i in more]
            stop_ids = m.add_requests(prompts[:3], max_new_tokens=10)
    if overlap and m.is_driver:  # the context's stop finishes what was queued: nothing lost
        rec["at_stop"] = [m.get_result(i, timeout=60).generated_tokens for i in stop_ids]
    return rec


def run(model_dir: str) -> dict:
    model = cluster.load(model_dir)
    return {"rank": model.groups.rank, **{mode: workload(model, on, model_dir)
                                          for mode, on in (("serial", False), ("overlap", True))}}


if __name__ == "__main__":
    record = run(sys.argv[1])
    with open(f"{sys.argv[2]}.rank{record['rank']}", "w") as f:
        json.dump(record, f)
