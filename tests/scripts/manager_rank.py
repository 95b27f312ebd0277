"""The manager API on every rank: streaming, cancel, pause with a weight change, stop variants, the queue
limit and result handlers, while other requests are in flight. Every rank runs `run`; rank 0 returns a record
that the test compares with transformers. Run directly (TP=1) or under torchrun (TP=2)."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import cluster
from tests.workloads import mixed_prompts
from worker.loader import load_weights

CFG = dict(page_size=16, max_batch_tokens=64)


def finished(manager, n: int, timeout: float = 120) -> dict:
    """n final outputs from the shared result list (any request)."""
    got, deadline = {}, time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished():
            got[out.request_id] = out
    return got


def run(dir_a: str, dir_b: str) -> dict:
    model = cluster.load(dir_a)
    rank = model.groups.rank
    prompts = mixed_prompts(model.config.vocab_size)
    rec: dict = {"rank": rank}

    # session 1: in-flight requests + streaming + cancel + pause with a weight change
    with model.continuous_batching_context_manager(
            continuous_batching_config=cluster.ContinuousBatchingConfig(**CFG)) as m:
        rec["is_running"] = m.is_running()
        ids = m.add_requests(prompts[:8], max_new_tokens=24)
        sid = m.add_request(prompts[8], max_new_tokens=6, streaming=True)
        cid = m.add_request(prompts[9], max_new_tokens=400, streaming=True)
        rec["worker_add_request_is_none"] = ids is None and sid is None and cid is None
        if rank == 0:
            first = m.get_result(cid, timeout=60)
            m.cancel_request(cid)
            cancel_outputs = [first] + list(m.request_id_iter(cid))
            rec["cancel"] = {"status": int(cancel_outputs[-1].status), "n_final": sum(o.is_finished() for o in cancel_outputs),
                             "tokens": len(cancel_outputs[-1].generated_tokens)}
            stream = list(m.request_id_iter(sid))
            rec["stream"] = [[len(o.generated_tokens), int(o.status)] for o in stream]
            rec["stream_tokens"] = stream[-1].generated_tokens
            rec["stream_prompt"] = prompts[8]
            rec["background"] = [m.get_result(i, timeout=120).generated_tokens for i in ids]
        else:
            rec["worker_finished"] = len(finished(m, 10))
        # more requests in flight while every rank pauses and loads checkpoint B in place
        inflight = m.add_requests(prompts[12:14], max_new_tokens=16)
        with m.pause():
            rec["paused_loop_alive"] = m.is_running()
            load_weights(model.model, dir_b)
        after = m.add_requests(prompts[10:12], max_new_tokens=24)
        if rank == 0:
            rec["inflight"] = [[len(o.generated_tokens), int(o.status)]
                               for o in (m.get_result(i, timeout=120) for i in inflight)]
            rec["after_pause_b"] = [m.get_result(i, timeout=120).generated_tokens for i in after]
            rec["free_blocks"] = m.stats()["free_blocks"] == m.stats()["num_blocks"]
        else:
            rec["worker_finished_2"] = len(finished(m, 4))
        with m.pause():
            load_weights(model.model, dir_a)
    rec["stopped"] = not m.is_running()

    # session 2: result handlers on an asyncio loop; keep the manager for the next session
    m2 = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(**CFG))
    m2.start()
    if rank == 0:
        async def with_handler():
            loop = asyncio.get_running_loop()
            done, seen = loop.create_future(), []

            def on_output(out):
                seen.append(len(out.generated_tokens))
                if out.is_finished():
                    done.set_result(out)
            rid = m2.add_request(prompts[3], max_new_tokens=5, streaming=True)
            m2.register_result_handler(rid, on_output)
            out = await asyncio.wait_for(done, 60)
            return seen, out.generated_tokens, rid in m2.results.handlers
        seen, toks, still = asyncio.run(with_handler())
        rec["handler"] = {"seen": seen, "tokens": toks, "handler_left": still}
    m2.stop(keep_for_next_session=True)
    rec["kept"] = model.persistent_manager is m2
    m3 = model.init_continuous_batching()
    rec["reused"] = m3 is m2
    m3.wants_results = True  # a worker is sent the outputs made once its caller reads: this one reads at once
    m3.start()
    rid = m3.add_request(prompts[4], max_new_tokens=4)
    if rank == 0:
        rec["reused_tokens"] = m3.get_result(rid, timeout=60).generated_tokens
    else:
        rec["worker_reused_finished"] = len(finished(m3, 1))
    m3.stop()
    m3.destroy()
    m3.destroy()  # idempotent
    rec["destroyed"] = m3.destroyed and model.persistent_manager is None

    # session 3: the queue limit, then a hard stop that fails what is pending
    m4 = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(
        max_queue_size=2, **CFG))
    if rank == 0:
        m4.add_request(prompts[1], max_new_tokens=300)
        m4.add_request(prompts[2], max_new_tokens=300)
        t0 = time.monotonic()
        try:
            m4.add_request(prompts[3], max_new_tokens=4)
            rec["queue_full"] = "accepted"
        except RuntimeError as e:
            rec["queue_full"] = str(e)
        rec["queue_full_s"] = time.monotonic() - t0
    m4.start()
    m4.stop(hard_stop=True)
    if rank == 0:
        outs = [m4.get_result(timeout=5) for _ in range(2)]
        rec["hard_stop"] = [[int(o.status), o.error] for o in outs if o is not None]
    m4.destroy()
    return rec


if __name__ == "__main__":
    record = run(sys.argv[1], sys.argv[2])
    with open(f"{sys.argv[3]}.rank{record['rank']}", "w") as f:
        json.dump(record, f)
