"""`benchmarks/throughput.py --cpu-offload GIB`: Lockstep alone, the same workload with cpu_offload_space off
and on, under a KV cache small enough (--num-blocks) to force preemption.

    python benchmarks/throughput.py --model models/small --num-blocks 24 --cpu-offload 1
    torchrun --nproc-per-node 2 benchmarks/throughput.py --model models/small --num-blocks 24 --cpu-offload 1

Pages are OFFLOAD_PAGE tokens here (throughput.py's 256-token pages are larger than its requests, which then
never grow into a second page and are never preempted). Each setting gets a warm-up call, then one timed
generate_batch call; the table shows its wall time, the preemptions, the pages swapped out and in, and the
tokens recomputed (KV dropped at a preemption and computed again). Off and on must produce the same tokens.
"""

from __future__ import annotations

import time
from typing import Any

OFFLOAD_PAGE = 32
STAT_KEYS = ("preemptions", "swapped_out_requests", "swapped_out_pages", "swapped_in_pages", "recomputed_tokens")


def run_offload_report(args: Any, prompts: list[list[int]], warm: list[list[int]], say: Any, barrier: Any,
                       gen_config: Any) -> int:
    """Every rank runs it (generate_batch is collective); rank 0 prints. Returns the exit status."""
    import cluster

    model = cluster.load(args.model, dtype=args.dtype, device=args.device)
    rows = []
    for space in (0.0, args.cpu_offload):
        cb = cluster.ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens, num_blocks=args.num_blocks,
                                              page_size=OFFLOAD_PAGE, use_cuda_graph=args.use_cuda_graph,
                                              cpu_offload_space=space)
        model.generate_batch(warm, generation_config=gen_config(8), continuous_batching_config=cb, max_new_tokens=8)
        barrier()
        t0 = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=gen_config(args.new_tokens),
                                   continuous_batching_config=cb, max_new_tokens=args.new_tokens)
        wall = time.perf_counter() - t0
        barrier()
        stats = dict(model.last_stats or {})
        rows.append(dict(space=space, wall=wall, tokens=[o.generated_tokens for o in out.values()],
                         host_pages=stats.get("num_host_blocks", 0), **{k: stats.get(k, 0) for k in STAT_KEYS}))
    say(f"\ncpu_offload_space off/on: {len(prompts)} prompts, {args.new_tokens} new tokens, num_blocks="
        f"{args.num_blocks} pages of {OFFLOAD_PAGE} tokens, device {args.device} (CPU timings are noisy)")
    say(f"{'offload GiB':>11} {'host pages':>10} {'wall s':>7} {'tok/s':>7} {'preempt':>7} {'swap-out req':>12} "
        f"{'pages out':>9} {'pages in':>8} {'recomputed tok':>14}")
    for r in rows:
        n = sum(len(t) for t in r["tokens"])
        say(f"{r['space']:>11.2f} {r['host_pages']:>10} {r['wall']:>7.2f} {n / r['wall']:>7.1f} {r['preemptions']:>7} "
            f"{r['swapped_out_requests']:>12} {r['swapped_out_pages']:>9} {r['swapped_in_pages']:>8} "
            f"{r['recomputed_tokens']:>14}")
    off, on = rows
    same = off["tokens"] == on["tokens"]
    say(f"recomputed tokens saved: {off['recomputed_tokens'] - on['recomputed_tokens']}; wall on/off "
        f"{on['wall'] / off['wall']:.2f}x; tokens identical off and on: {same}")
    if not off["preemptions"]:
        say("note: nothing was preempted; lower --num-blocks")
    return 0 if same else 1
