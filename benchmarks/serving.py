"""Online serving: requests arriving at a steady rate, TTFT / TPOT / throughput, Lockstep against transformers.

    python benchmarks/serving.py --model models/small             # Lockstep at TP=1, then transformers
    python benchmarks/serving.py --model models/small --tp 2      # Lockstep at TP=2 (two ranks), then transformers

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

Per request: arrival a (scheduled: i / rate seconds after the start), first-token time f, last-token time l, n
tokens. TTFT = f - a; TPOT = (l - f) / (n - 1); throughput = all tokens / (last l - first a). Times are taken
where the tokens reach the caller (the client process for Lockstep, after the ZeroMQ hop). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # nothing heavy at module level: the spawned client process imports this file

from benchmarks.serving_common import NUM_WARM, PAGE, WARM_TOKENS, CpuWindow, say, speed_probe  # noqa: E402
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

        threads = []
        t0 = time.perf_counter() + 0.05
        for i, a in enumerate(arrivals):
            delay = t0 + a - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=one, args=(i, t0), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        stats_after = client.stats()
        client.close()
        for rec, a in zip(recs, arrivals):
            rec["arrival"] = a
        out_q.put({"records": recs, "stats_before": stats_before, "stats_after": stats_after})
    except BaseException as e:
        import traceback

        out_q.put({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})


def preset_toml(args) -> str:
    lines = ["[continuous_batching]", f"page_size = {PAGE}", f"num_blocks = {args.num_blocks}",
             "cpu_group_timeout = 120.0"]
    if args.model_samples:  # greedy must then be asked per request, which needs per-request processors
        lines.append("per_request_processors = true")
    if args.max_batch_tokens:
        lines.append(f"max_batch_tokens = {args.max_batch_tokens}")
    return "\n".join(lines) + "\n"


def run_lockstep(args, prompts, warm, arrivals) -> dict:
    import multiprocessing as mp

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
        ctx = mp.get_context("spawn")
        out_q = ctx.Queue()
        sampling = {"do_sample": False} if args.model_samples else {}  # else the server's default is greedy
        client = ctx.Process(target=client_main, args=(got, prompts, warm, arrivals, args.new_tokens, sampling,
                                                       out_q))
        client.start()
        try:
            msg = out_q.get(timeout=args.run_timeout)
        except queue.Empty:
            msg = {"error": f"the client sent nothing within {args.run_timeout}s"}
        client.join(30)
        if client.is_alive():
            client.kill()
            client.join(5)
        if "error" in msg:
            raise RuntimeError(f"client process failed: {msg['error']}")
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


# ------------------------------------------------------------------------------------------------ transformers
# ------------------------------------------------------------------------------------------------ report
def pct(values: list[float], q: float) -> float:
    """The q-th percentile, linear between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(args, r: dict) -> dict:
    recs = r["records"]
    ok = [x for x in recs if x.get("first") is not None and x.get("last") is not None]
    ttft = [1000 * (x["first"] - x["arrival"]) for x in ok]
    tpot = [1000 * (x["last"] - x["first"]) / (x["n"] - 1) for x in ok if x["n"] > 1]
    tokens = sum(x.get("n", 0) for x in recs)
    span = (max(x["last"] for x in ok) - min(x["arrival"] for x in recs)) if ok else float("nan")
    counts = [x.get("n", 0) for x in recs]
    lag = [1000 * (x["submit"] - x["arrival"]) for x in recs if "submit" in x]
    hop = {}
    srv = [x for x in ok if x.get("srv_first", -1e9) > x["arrival"] - 1]  # Lockstep: the server's timestamps
    if srv:
        hop = {"submit -> server add_request": [1000 * (x["srv_created"] - x["submit"]) for x in srv],
               "server: add_request -> 1st token sampled": [1000 * (x["srv_first"] - x["srv_created"]) for x in srv],
               "1st token sampled -> client": [1000 * (x["first"] - x["srv_first"]) for x in srv],
               "last token sampled -> client": [1000 * (x["last"] - x["srv_end"]) for x in srv]}
    return dict(hop=hop, ttft50=pct(ttft, 50), ttft99=pct(ttft, 99), tpot50=pct(tpot, 50), tpot99=pct(tpot, 99),
                ttft_mean=sum(ttft) / max(1, len(ttft)), tpot_mean=sum(tpot) / max(1, len(tpot)),
                tps=tokens / span, tokens=tokens, span=span, counts=counts, max_lag=max(lag) if lag else float("nan"),
                exact=len(counts) == args.num_requests and all(n == args.new_tokens for n in counts)
                and all(x.get("status") == "FINISHED" for x in recs),
                errors=[x["error"] for x in recs if x.get("error")])


def report(args, results: list[dict]) -> bool:
    say(f"\nworkload: {args.num_requests} requests at {args.rate:g}/s (arrival i/{args.rate:g} s), prompt lengths "
        f"U[{args.min_len}, {args.max_len}] (seed {args.seed}), {args.new_tokens} new tokens each, greedy, EOS "
        f"disabled; both engines: page_size={PAGE} num_blocks={args.num_blocks} max_batch_tokens="
        f"{args.max_batch_tokens} (None = each engine's default); warm-up {NUM_WARM} x {WARM_TOKENS} tokens")
    args.probes.append(speed_probe())
    say(f"cpus={os.cpu_count()}, load average (1 min) {args.load_before:.2f} at start, {os.getloadavg()[0]:.2f} "
        f"at end; speed probe {' / '.join(f'{x:.1f}' for x in args.probes)} ms (start / between engines / end; "
        f"lower is faster)\n")
    say(f"{'engine':<13} {'TP':>2} {'threads':>7} {'requests':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
        f"{'TPOT p99':>9} {'tok/s':>7}")
    say(f"{'':<13} {'':>2} {'':>7} {'':>8} {'ms':>9} {'ms':>9} {'ms':>9} {'ms':>9} {'':>7}")
    all_exact = True
    for r in results:
        s = r["s"] = summarize(args, r)
        say(f"{r['engine']:<13} {r['tp']:>2} {r['threads']:>7} {len(r['records']):>8} {s['ttft50']:>9.1f} "
            f"{s['ttft99']:>9.1f} {s['tpot50']:>9.1f} {s['tpot99']:>9.1f} {s['tps']:>7.1f}")
    say("")
    for r in results:
        s = r["s"]
        all_exact &= s["exact"]
        others, wall = r["others"]
        say(f"{r['engine']}: tokens per request min {min(s['counts'])} max {max(s['counts'])} over "
            f"{len(s['counts'])} requests ({'all exactly' if s['exact'] else 'NOT all'} {args.new_tokens}, "
            f"{s['tokens']} in all); first arrival to last token {s['span']:.2f} s; TTFT mean {s['ttft_mean']:.1f} "
            f"ms, TPOT mean {s['tpot_mean']:.1f} ms; latest submit {s['max_lag']:.1f} ms after its arrival time")
        say(f"    {r['note']}; other processes' CPU while this engine ran: {others:.1f} s over {wall:.0f} s")
        if s["hop"]:
            say("    where TTFT goes (server timestamps, same clock), p50 / p99 ms: " + "; ".join(
                f"{k} {pct(v, 50):.1f} / {pct(v, 99):.1f}" for k, v in s["hop"].items()))
        for e in s["errors"][:3]:
            say(f"    error: {e}")
    by = {r["engine"]: r["s"] for r in results}
    if "lockstep" in by and "transformers" in by:
        a, b = by["lockstep"], by["transformers"]
        ra, rb = ([x.get("tokens") for x in r["records"]] for r in results[:2])
        same = sum(x is not None and x == y for x, y in zip(ra, rb))
        say(f"same generated tokens in both engines: {same}/{len(ra)} requests (greedy, float32; a random model's "
            f"near-tied logits may still flip a token)")
        say(f"lockstep/transformers: TTFT p50 ratio {a['ttft50'] / b['ttft50']:.2f}, TTFT p99 ratio "
            f"{a['ttft99'] / b['ttft99']:.2f}, TPOT p50 ratio {a['tpot50'] / b['tpot50']:.2f}, TPOT p99 ratio "
            f"{a['tpot99'] / b['tpot99']:.2f}, throughput ratio {a['tps'] / b['tps']:.2f} (below 1 = lockstep "
            f"faster, except throughput)")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "s"}
                                               | {"summary": {k: v for k, v in r["s"].items() if k != "hop"}}
                                               for r in results], indent=1))
    return all_exact


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
    p.add_argument("--json", help="also write every request's timestamps here")
    args = p.parse_args()
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    if args.new_tokens < 2 or args.rate <= 0 or args.num_requests < 1:
        p.error("need --new-tokens >= 2, --rate > 0, --num-requests >= 1")

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

    results = []
    if not args.skip_lockstep:
        results.append(run_lockstep(args, prompts, warm, arrivals))
        args.probes.append(speed_probe())
        say(f"load average (1 min) after lockstep: {os.getloadavg()[0]:.2f}; speed probe {args.probes[-1]:.1f} ms")
    if not args.skip_transformers:
        results.append(run_transformers(args, prompts, warm, arrivals))
    ok = report(args, results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
