"""Online serving: requests arriving at a steady rate, TTFT / TPOT / throughput, Lockstep against transformers.

    python benchmarks/serving.py --model models/small             # Lockstep at TP=1, then transformers
    python benchmarks/serving.py --model models/small --tp 2      # Lockstep at TP=2 (two ranks), then transformers
    python benchmarks/serving.py --model models/small --http      # ZeroMQ, Lockstep's HTTP gateway, transformers serve

One invocation runs both engines on the same workload, one after the other (never at the same time):

1. Lockstep: `python -m launch.cli serve --model DIR --tp N --config PRESET --address tcp://127.0.0.1:PORT` in its
   own process group (PRESET is a temporary TOML with a [continuous_batching] table); once it prints
   `ready <address>`, a separate client process (multiprocessing, spawn) sends the requests with
   `cluster.Client.stream`, one thread per request, at the precomputed arrival times, and sends its timestamps
   back through a queue. The server is stopped (SIGINT to its group) before transformers starts.
2. transformers: `model.init_continuous_batching(...)`, `warmup()`, `start()` in this process; a feeder thread
   calls `add_request(..., streaming=True)` at the same arrival times and a collector thread reads every
   streamed output with `get_result`.

Both engines get the same warm-up (4 short requests, 8 tokens) before the timed schedule, the same
ContinuousBatchingConfig fields (--num-blocks, --max-batch-tokens) and greedy decoding with EOS disabled, so that
every request produces exactly --new-tokens tokens (checked; exit status 1 if not).

With --http (the checkpoint needs a tokenizer) the engines are Lockstep over ZeroMQ, Lockstep through its OpenAI
gateway (`lockstep serve --http`) and `transformers serve --continuous-batching` (benchmarks/serving_http.py), on the
same text prompts (the ZeroMQ run sends the ids they tokenize to) and arrivals.

Per request: arrival a (scheduled: i / rate seconds after the start), first-token time f, last-token time l, n
tokens. TTFT = f - a; TPOT = (l - f) / (n - 1); throughput = all tokens / (last l - first a). Times are taken
where the tokens reach the caller (the client process for Lockstep, after the ZeroMQ hop). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # nothing heavy at module level: the spawned client process imports this file

from benchmarks.serving_common import (  # noqa: E402
    NUM_WARM, PAGE, WARM_TOKENS, CpuWindow, client_message, on_arrivals, say, speed_probe)
from benchmarks.serving_common import preset_toml  # noqa: E402
from benchmarks.serving_report import report  # noqa: E402
from benchmarks.serving_transformers import run_transformers  # noqa: E402


# ------------------------------------------------------------------------------------------------ workload
def ensure_model(model_dir: Path) -> None:
    if (model_dir / "config.json").exists():
        return
    from launch.make_model import make_model

    say(f"no checkpoint in {model_dir}: writing llama/small (seed 0)")
    tmp = model_dir.with_name(f"{model_dir.name}.tmp-{os.getpid()}")
    make_model(tmp, arch="llama", size="small", seed=0)
    if model_dir.exists():
        model_dir.rmdir()
    os.rename(tmp, model_dir)


def make_prompts(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_requests)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# ------------------------------------------------------------------------------------------------ Lockstep
def client_main(address: str, prompts: list[list[int]], warm: list[list[int]], arrivals: list[float],
                new_tokens: int, sampling: dict, out_q) -> None:
    """The client process: warm-up, then one thread per request, each started at its arrival time."""
    try:
        from cluster.client import Client

        client = Client(address, timeout=900)
        warm_threads = [threading.Thread(target=lambda p=p: list(client.stream(p, max_new_tokens=WARM_TOKENS,
                                                                               eos_token_id=-1, **sampling)))
                        for p in warm]
        for t in warm_threads:
            t.start()
        for t in warm_threads:
            t.join()
        stats_before = client.stats()

        recs: list[dict] = [{} for _ in prompts]

        def one(i: int, t0: float) -> None:
            rec = recs[i]
            rec["submit"] = time.perf_counter() - t0
            n, first, last, status, err = 0, None, None, None, None
            try:
                for out in client.stream(prompts[i], max_new_tokens=new_tokens, eos_token_id=-1, **sampling):
                    now = time.perf_counter() - t0
                    if first is None and out.generated_tokens:
                        first = now
                    if len(out.generated_tokens) > n:
                        last = now
                    n, status = len(out.generated_tokens), out.status.name
                    if out.is_finished():  # the server's own clock (perf_counter is CLOCK_MONOTONIC: shared)
                        rec["tokens"] = list(out.generated_tokens)
                        rec.update(srv_created=out.created_time - t0, srv_first=out.lifespan[0] - t0,
                                   srv_end=out.lifespan[1] - t0)
            except Exception as e:  # recorded and reported; the run goes on
                err = f"{type(e).__name__}: {e}"
            rec.update(first=first, last=last, n=n, status=status, error=err)

        on_arrivals(arrivals, one)
        stats_after = client.stats()
        client.close()
        for rec, a in zip(recs, arrivals):
            rec["arrival"] = a
        out_q.put({"records": recs, "stats_before": stats_before, "stats_after": stats_after})
    except BaseException as e:
        import traceback

        out_q.put({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})


def run_lockstep(args, prompts, warm, arrivals) -> dict:

    from launch.local_server import local_server

    window = CpuWindow()
    say(f"lockstep: starting lockstep serve --model {args.model} --tp {args.tp} "
        f"(OMP_NUM_THREADS={args.server_threads}); preset:\n"
        + "".join(f"    {line}\n" for line in preset_toml(args).splitlines()))
    t_start = time.monotonic()
    result: dict = {"engine": "lockstep", "tp": args.tp, "threads": args.server_threads}
    with local_server(args.model, args.tp, preset_toml(args), env={"OMP_NUM_THREADS": str(args.server_threads)},
                      ready_timeout=args.ready_timeout) as server:
        got = server.address
        say(f"lockstep: ready at {got} after {time.monotonic() - t_start:.1f}s; client process (spawn) starts")
        sampling = {"do_sample": False} if args.model_samples else {}  # else the server's default is greedy
        msg = client_message(client_main, (got, prompts, warm, arrivals, args.new_tokens, sampling),
                             args.run_timeout, "client process")
        result["records"] = msg["records"]
        sb, sa = msg["stats_before"], msg["stats_after"]
        result["note"] = (f"server steps in the timed run {sa.get('step', 0) - sb.get('step', 0)}, preemptions "
                          f"{sa.get('preemptions', 0) - sb.get('preemptions', 0)}, num_blocks {sa.get('num_blocks')}")
        rc = server.stop()
        result["server_rc"] = rc
        if os.environ.get("BENCH_DEBUG"):
            say("lockstep server log:\n" + server.log[-6000:])
    others, wall = window.others()
    result["others"] = (others, wall)
    say(f"lockstep: server stopped (exit status {rc}; torchrun exits 1 when SIGINT stops it)")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory (llama/small written there if missing)")
    p.add_argument("--tp", type=int, default=1, help="Lockstep's tensor-parallel degree (transformers runs TP=1)")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (arrival of request i: i / rate)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="passed to both engines' ContinuousBatchingConfig (default: each engine's own)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV pages of 256 tokens for both engines (default: enough for every request at once)")
    p.add_argument("--server-threads", type=int, default=None,
                   help="OMP_NUM_THREADS of each Lockstep rank (default: cpus // tp; `lockstep serve` alone "
                        "would use 1)")
    p.add_argument("--skip-lockstep", action="store_true")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for the server to print `ready`")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds for one engine's timed run")
    p.add_argument("--runs", type=int, default=1,
                   help="pairs of runs, engines alternating (lockstep, transformers, lockstep, ...); the report "
                        "gives each pair's ratios and their medians")
    p.add_argument("--json", help="also write every request's timestamps here")
    p.add_argument("--http", action="store_true",
                   help="compare over HTTP: Lockstep ZeroMQ, Lockstep's OpenAI gateway, `transformers serve "
                        "--continuous-batching` (instead of transformers in this process)")
    args = p.parse_args()
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    if args.new_tokens < 2 or args.rate <= 0 or args.num_requests < 1 or args.runs < 1:
        p.error("need --new-tokens >= 2, --rate > 0, --num-requests >= 1, --runs >= 1")

    args.load_before = os.getloadavg()[0]
    args.probes = [speed_probe()]
    say(f"load average (1 min) at start: {args.load_before:.2f} (cpus={os.cpu_count()}); speed probe "
        f"{args.probes[0]:.1f} ms")
    if args.num_blocks is None:
        args.num_blocks = args.num_requests * math.ceil((args.max_len + args.new_tokens) / PAGE)
    if args.server_threads is None:
        args.server_threads = max(1, (os.cpu_count() or 1) // args.tp)
    args.model = Path(args.model).resolve()
    ensure_model(args.model)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    gen_file = args.model / "generation_config.json"
    # the server decodes with the checkpoint's generation config; requests override max_new_tokens and EOS
    args.model_samples = bool(gen_file.exists() and json.loads(gen_file.read_text()).get("do_sample"))
    prompts = make_prompts(args, vocab)
    warm = [x[:args.min_len] for x in prompts[:NUM_WARM]]
    arrivals = [i / args.rate for i in range(args.num_requests)]

    engines = [] if args.skip_lockstep else [("lockstep", run_lockstep, prompts, warm)]
    if args.http:
        from benchmarks.serving_http import run_lockstep_http, run_transformers_serve, text_prompts

        texts, ids = text_prompts(args.model, prompts)
        engines = [] if args.skip_lockstep else [("lockstep", run_lockstep, ids, ids[:NUM_WARM]),
                                                 ("lockstep-http", run_lockstep_http, texts, texts[:NUM_WARM])]
        engines += [] if args.skip_transformers else [("transformers-serve", run_transformers_serve, texts,
                                                       texts[:NUM_WARM])]
    elif not args.skip_transformers:
        engines.append(("transformers", run_transformers, prompts, warm))
    results = []
    for run in range(1, args.runs + 1):
        for name, engine, engine_prompts, engine_warm in engines:
            say(f"--- run {run} of {args.runs}: {name}")
            results.append(engine(args, engine_prompts, engine_warm, arrivals) | {"run": run})
            args.probes.append(speed_probe())
            say(f"load average (1 min) after {name}: {os.getloadavg()[0]:.2f}; speed probe {args.probes[-1]:.1f} ms")
    ok = report(args, results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
