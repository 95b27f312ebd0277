"""How long a rank crash costs: `lockstep serve` at TP=2, N streaming requests in flight, one rank killed with
SIGKILL mid-generation; the time from the kill to the first token of a resumed request, and to the last
completion, with every request checked token for token against an uninterrupted run of it.

    python -m benchmarks.recovery --model models/small --requests 32 --new-tokens 64 --rank 1

The group restarts by itself (`--max-restarts` 3, the default) and the client resumes every request
(cluster/client/resume.py). Prints one JSON line. On a shared CPU machine the figures are noisy: most of the
pause is the restarted group's start (processes, imports, loading the checkpoint, warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

from benchmarks.serving_common import say
from cluster.client import Client
from launch.local_server import local_server

PRESET = """
[continuous_batching]
page_size = 16
max_batch_tokens = 512
max_requests_per_batch = 64
cpu_group_timeout = 10.0
"""


def rank_pid(address: str, rank: int) -> int:
    """The pid of one rank of the server at `address` (its RANK environment variable, its command line)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"launch.serve" in cmd and f"RANK={rank}".encode() in env and address.encode() in cmd:
            return int(pid)
    raise RuntimeError(f"rank {rank} of {address} not found")


def run_requests(client: Client, n: int, new_tokens: int, tag: str, arrivals: dict) -> dict[str, list[int]]:
    """n streaming requests at once (seeded sampling on every other one); their final tokens. `arrivals[rid]`
    collects (time, tokens so far, resumes) for every streamed output."""
    finals: dict[str, list[int]] = {}

    def one(i: int) -> None:
        rid = f"{tag}-{i}"
        params = {"do_sample": True, "temperature": 0.8, "top_k": 40, "seed": i} if i % 2 else {}
        for out in client.stream([1, 5 + i, 9, 13 + i], request_id=rid, max_new_tokens=new_tokens,
                                 eos_token_id=-1, **params):
            arrivals.setdefault(rid, []).append((time.monotonic(), len(out.generated_tokens), out.resumes))
        finals[rid] = out.generated_tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return finals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks.recovery")
    p.add_argument("--model", default="models/small")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=1, help="the rank to kill (0: the driver)")
    p.add_argument("--kill-after", type=float, default=0.25, help="kill once this share of the tokens came")
    args = p.parse_args(argv)
    with local_server(args.model, tp=2, config=PRESET, env={"OMP_NUM_THREADS": "1"}, ready_timeout=300) as server:
        with Client(server.address, timeout=600, server_timeout_s=3.0, resume_timeout_s=300) as c:
            say("uninterrupted run ...")
            reference = run_requests(c, args.requests, args.new_tokens, "r", {})
            arrivals: dict[str, list] = {}
            killed: dict[str, float] = {}
            total = args.requests * args.new_tokens

            def kill() -> None:
                while sum(a[-1][1] for a in list(arrivals.values()) if a) < args.kill_after * total:
                    time.sleep(0.01)
                in_flight = sum(1 for a in list(arrivals.values()) if a and a[-1][1] < args.new_tokens)
                os.kill(rank_pid(server.address, args.rank), signal.SIGKILL)
                killed.update(at=time.monotonic(), in_flight=in_flight)
                say(f"killed rank {args.rank} with {in_flight} requests in flight")

            killer = threading.Thread(target=kill)
            killer.start()
            got = run_requests(c, args.requests, args.new_tokens, "r", arrivals)
            killer.join()
            health = c.health()
    t0 = killed["at"]
    resumed = [t for a in arrivals.values() for t, _, r in a if r and t > t0]
    result = {"model": args.model, "tp": 2, "killed_rank": args.rank, "requests": args.requests,
              "new_tokens": args.new_tokens, "in_flight_at_kill": killed["in_flight"],
              "kill_to_first_resumed_token_s": round(min(resumed) - t0, 2) if resumed else None,
              "kill_to_last_completion_s": round(max(a[-1][0] for a in arrivals.values()) - t0, 2),
              "resumed_requests": sum(1 for a in arrivals.values() if a[-1][2]),
              "token_exact": got == reference, "restart_count": health["restart_count"]}
    print(json.dumps(result), flush=True)
    return 0 if result["token_exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
