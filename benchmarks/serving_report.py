"""The report of benchmarks/serving.py: per-request latencies summarised per engine and run, the table, the
ratios of each run's pair (Lockstep / transformers, same workload, one after the other) and their medians."""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

from benchmarks.serving_common import NUM_WARM, PAGE, WARM_TOKENS, say, speed_probe

PAIRS = (("lockstep", "transformers"), ("lockstep-http", "transformers-serve"), ("lockstep-http", "lockstep"))
RATIOS = (("TTFT p50", "ttft50"), ("TTFT p99", "ttft99"), ("TPOT p50", "tpot50"), ("TPOT p99", "tpot99"),
          ("throughput", "tps"))


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
    """Print the table (one row per engine and run), the details, each run's ratios and their medians."""
    say(f"\nworkload: {args.num_requests} requests at {args.rate:g}/s (arrival i/{args.rate:g} s), prompt lengths "
        f"U[{args.min_len}, {args.max_len}] (seed {args.seed}), {args.new_tokens} new tokens each, greedy, EOS "
        f"disabled; both engines: page_size={PAGE} num_blocks={args.num_blocks} max_batch_tokens="
        f"{args.max_batch_tokens} (None = each engine's default); warm-up {NUM_WARM} x {WARM_TOKENS} tokens; "
        f"{args.runs} run(s), engines alternating")
    args.probes.append(speed_probe())
    say(f"cpus={os.cpu_count()}, load average (1 min) {args.load_before:.2f} at start, {os.getloadavg()[0]:.2f} "
        f"at end; speed probe {' / '.join(f'{x:.1f}' for x in args.probes)} ms (at start, after each engine; "
        f"lower is faster)\n")
    say(f"{'engine':<13} {'run':>3} {'TP':>2} {'threads':>7} {'requests':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9} {'tok/s':>7}")
    say(f"{'':<13} {'':>3} {'':>2} {'':>7} {'':>8} {'ms':>9} {'ms':>9} {'ms':>9} {'ms':>9} {'':>7}")
    all_exact = True
    for r in results:
        s = r["s"] = summarize(args, r)
        say(f"{r['engine']:<13} {r['run']:>3} {r['tp']:>2} {r['threads']:>7} {len(r['records']):>8} "
            f"{s['ttft50']:>9.1f} {s['ttft99']:>9.1f} {s['tpot50']:>9.1f} {s['tpot99']:>9.1f} {s['tps']:>7.1f}")
    say("")
    for r in results:
        s = r["s"]
        all_exact &= s["exact"]
        others, wall = r["others"]
        say(f"{r['engine']} (run {r['run']}): tokens per request min {min(s['counts'])} max {max(s['counts'])} over "
            f"{len(s['counts'])} requests ({'all exactly' if s['exact'] else 'NOT all'} {args.new_tokens}, "
            f"{s['tokens']} in all); first arrival to last token {s['span']:.2f} s; TTFT mean {s['ttft_mean']:.1f} "
            f"ms, TPOT mean {s['tpot_mean']:.1f} ms; latest submit {s['max_lag']:.1f} ms after its arrival time")
        say(f"    {r['note']}; other processes' CPU while this engine ran: {others:.1f} s over {wall:.0f} s")
        if s["hop"]:
            say("    where TTFT goes (server timestamps, same clock), p50 / p99 ms: " + "; ".join(
                f"{k} {pct(v, 50):.1f} / {pct(v, 99):.1f}" for k, v in s["hop"].items()))
        for e in s["errors"][:3]:
            say(f"    error: {e}")
    report_ratios(results)
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "s"}
                                               | {"summary": {k: v for k, v in r["s"].items() if k != "hop"}}
                                               for r in results], indent=1))
    return all_exact


def report_ratios(results: list[dict]) -> None:
    """Each run's ratios of each pair of engines present (below 1: the first faster, except throughput), then
    medians."""
    pairs: dict[str, list[dict]] = {}
    for run in sorted({r["run"] for r in results}):
        by = {r["engine"]: r for r in results if r["run"] == run}
        for first, second in PAIRS:
            if first not in by or second not in by:
                continue
            a, b = by[first], by[second]
            key = next((k for k in ("text", "tokens") if k in a["records"][0] and k in b["records"][0]), None)
            ra, rb = ([x.get(key) for x in r["records"]] for r in (a, b))
            same = f"same generated {key} in both {sum(x is not None and x == y for x, y in zip(ra, rb))}/{len(ra)}" \
                if key else "outputs not comparable"
            ratios = {name: a["s"][k] / b["s"][k] for name, k in RATIOS}
            pairs.setdefault(f"{first}/{second}", []).append(ratios)
            say(f"run {run}: {same}; {first}/{second}: "
                + ", ".join(f"{name} {v:.2f}" for name, v in ratios.items()))
    for pair, runs in pairs.items():
        if len(runs) > 1:
            say(f"median over {len(runs)} runs, {pair}: " + ", ".join(
                f"{name} {statistics.median(p[name] for p in runs):.2f}" for name, _ in RATIOS))
    if pairs:
        say("(ratios below 1 = lockstep faster, except throughput; a random model's near-tied logits may flip a "
            "token between engines)")
