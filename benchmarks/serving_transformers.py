"""The transformers side of benchmarks/serving.py: its continuous-batching manager in this process, fed the same
arrival times by a feeder thread while a collector thread reads every streamed output."""

from __future__ import annotations

import os
import threading
import time

from benchmarks.serving_common import PAGE, WARM_TOKENS, CpuWindow, say


def run_transformers(args, prompts, warm, arrivals) -> dict:
    import logging

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    window = CpuWindow()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.INFO if os.environ.get("BENCH_DEBUG")
                                                           else logging.ERROR)
    say(f"transformers: loading {args.model} in this process (torch threads {torch.get_num_threads()})")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=args.new_tokens)
    from benchmarks.hf_compat import make_cb_config, page_size_of

    cb = make_cb_config(transformers.ContinuousBatchingConfig, page_size=PAGE, num_blocks=args.num_blocks,
                        max_batch_tokens=args.max_batch_tokens)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.warmup()
    manager.start()
    try:
        # the same warm-up as Lockstep's: 4 short requests at once, read to the end
        for j, p in enumerate(warm):
            manager.add_request(p, request_id=f"warm_{j}", max_new_tokens=WARM_TOKENS, streaming=True)
        done = 0
        while done < len(warm):
            out = manager.get_result(timeout=60)
            if out is None:
                raise RuntimeError("transformers: warm-up produced nothing for 60 s")
            done += out.is_finished()
        steps_before = getattr(manager, "current_batch", 0)

        recs: list[dict] = [{"arrival": a} for a in arrivals]
        index = {f"bench_{i}": i for i in range(len(prompts))}
        t0 = time.perf_counter() + 0.05
        finished = threading.Event()

        def feed() -> None:
            for i, a in enumerate(arrivals):
                delay = t0 + a - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                recs[i]["submit"] = time.perf_counter() - t0
                manager.add_request(prompts[i], request_id=f"bench_{i}", max_new_tokens=args.new_tokens,
                                    streaming=True)

        def collect() -> None:
            left = len(prompts)
            deadline = time.monotonic() + args.run_timeout
            while left and time.monotonic() < deadline:
                out = manager.get_result(timeout=0.5)
                if out is None:
                    if not manager.is_running():
                        break
                    continue
                now = time.perf_counter() - t0
                rec = recs[index[out.request_id]]
                n = len(out.generated_tokens)
                if n and rec.get("first") is None:
                    rec["first"] = now
                if n > rec.get("n", 0):
                    rec["last"] = now
                rec["n"] = n
                if out.is_finished():
                    rec["tokens"] = list(out.generated_tokens)
                rec["status"] = out.status.name
                if out.error:
                    rec["error"] = out.error
                if out.is_finished():
                    left -= 1
            finished.set()

        feeder = threading.Thread(target=feed, daemon=True)
        collector = threading.Thread(target=collect, daemon=True)
        collector.start()
        feeder.start()
        feeder.join()
        collector.join()
        steps = getattr(manager, "current_batch", 0) - steps_before
        c = manager.continuous_batching_config
        note = (f"steps in the timed run {steps}; max_batch_tokens={c.max_batch_tokens} "
                f"max_requests_per_batch={c.max_requests_per_batch} num_blocks={c.num_blocks} "
                f"page_size={page_size_of(c)} attn={model.config._attn_implementation}")
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    others, wall = window.others()
    return {"engine": "transformers", "tp": 1, "threads": torch.get_num_threads(), "records": recs, "note": note,
            "others": (others, wall)}
