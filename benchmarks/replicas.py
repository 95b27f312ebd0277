"""Replicas behind one router (docs/replicas.md), in one invocation on a local Ray:

1. throughput of 1 replica and of 2 replicas (TP=1 each) through the router, the same greedy workload from
   several clients (generated tokens per second of wall time);
2. the prefix-cache hit rate on a shared-prefix workload with affinity routing against round-robin, on the same
   2 replicas (each policy gets its own prompt families, so neither finds the other's pages cached).

    python -m benchmarks.replicas --model models/tiny-llama --requests 256 --new-tokens 32

Hit rate: the replicas' `prefix_hit_blocks` over the full prompt pages a block manager could have reused
(every prompt's pages but the first prompt's of each family). Prints one JSON line at the end. The figures are
noisy on a shared CPU machine: each replica's rank is one process with OMP_NUM_THREADS=1, so 2 replicas can only
double the throughput when two cores are free.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.serving_common import say
from cluster.client import Client
from launch.router.replicas import start_replicas

PAGE = 16
PRESET = {"continuous_batching": {"page_size": PAGE, "max_batch_tokens": 512, "max_requests_per_batch": 64,
                                  "cpu_group_timeout": 10.0},
          "serve": {"client_timeout_s": 30.0}}


def load(address: str, prompts: list[list[int]], new_tokens: int, clients: int = 4) -> tuple[float, int]:
    """Every prompt once, spread over `clients` clients (8 in flight each): (wall seconds, tokens generated)."""
    tokens = [0] * clients

    def client(no: int) -> None:
        with Client(address, timeout=600) as c, ThreadPoolExecutor(8) as pool:
            outs = pool.map(lambda p: c.generate(p, max_new_tokens=new_tokens, eos_token_id=-1),
                            prompts[no::clients])
            tokens[no] = sum(len(o.generated_tokens) for o in outs)

    t = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t, sum(tokens)


def random_prompts(n: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(16, 128))] for _ in range(n)]


def families(n_fam: int, per_fam: int, vocab: int, rng: random.Random) -> tuple[list[list[int]], int]:
    """`n_fam` families of `per_fam` prompts sharing 128 to 256 tokens, shuffled; and the reusable pages."""
    prompts, reusable = [], 0
    for _ in range(n_fam):
        prefix = [rng.randrange(3, vocab) for _ in range(rng.randrange(128, 257))]
        fam = [prefix + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 32))] for _ in range(per_fam)]
        prompts += fam
        reusable += (per_fam - 1) * (len(prefix) // PAGE)
    rng.shuffle(prompts)
    return prompts, reusable


def hit_rate(fleet, prompts: list[list[int]], reusable: int, new_tokens: int, policy: str) -> dict:
    fleet.router.pool.policy = policy
    with fleet.client() as c:
        before = c.stats()["prefix_hit_blocks"]
        seconds, _ = load(fleet.address, prompts, new_tokens)
        after = c.stats()
    hits = after["prefix_hit_blocks"] - before
    return {"policy": policy, "prefix_hit_blocks": hits, "reusable_blocks": reusable,
            "hit_rate": round(hits / reusable, 3), "seconds": round(seconds, 2),
            "routed": [r["routed"] for r in after["replicas"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--families", type=int, default=32)
    ap.add_argument("--per-family", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    rng = random.Random(0)
    work = random_prompts(args.requests, args.vocab, rng)
    report: dict = {"model": args.model, "requests": args.requests, "new_tokens": args.new_tokens,
                    "cores": os.cpu_count(), "throughput": {}}
    try:
        for n in (1, 2):
            fleet = start_replicas(args.model, tp=1, replicas=n, config=PRESET, address="tcp://127.0.0.1:*")
            try:
                load(fleet.address, work[:16], 4)  # warm-up
                load_before = os.getloadavg()[0]
                seconds, tokens = load(fleet.address, work, args.new_tokens)
                report["throughput"][f"{n}_replica"] = {"tokens_per_s": round(tokens / seconds, 1),
                                                        "seconds": round(seconds, 2), "tokens": tokens,
                                                        "loadavg_before": round(load_before, 2)}
                say(f"{n} replica(s): {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")
                if n == 2:
                    report["prefix"] = []
                    for policy in ("affinity", "round_robin"):
                        prompts, reusable = families(args.families, args.per_family, args.vocab, rng)
                        report["prefix"].append(hit_rate(fleet, prompts, reusable, 4, policy))
                        say(f"prefix cache, {policy}: {report['prefix'][-1]}")
            finally:
                fleet.shutdown()
    finally:
        ray.shutdown()
    t = report["throughput"]
    report["speedup_2_vs_1"] = round(t["2_replica"]["tokens_per_s"] / t["1_replica"]["tokens_per_s"], 2)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
