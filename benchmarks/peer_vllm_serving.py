"""Peer benchmark, online: TTFT / TPOT through Lockstep's OpenAI gateway and vLLM's OpenAI server (its CPU build).

    python benchmarks/peer_vllm_serving.py --model models/small                # 3 runs, 1 and 4 req/s, TP=1
    python benchmarks/peer_vllm_serving.py --model models/small --quick        # 1 run, 16 requests of 32 tokens
    python benchmarks/peer_vllm_serving.py --model models/small --tp 2 --rates 2 8 --venv DIR

The online half of benchmarks/peer_vllm.py (which compares the offline calls). Each run starts Lockstep's server
(`lockstep serve --http`, launch/local_server.py) and then vLLM's (`VENV/bin/python -m
vllm.entrypoints.openai.api_server`: the package's `vllm serve` script is broken), one after the other, never both
at once; each server's start (process launch to /health answering 200: model load, vLLM's torch.compile and both
engines' own warm-ups) and this benchmark's warm-up (NUM_WARM requests of WARM_TOKENS tokens) are timed apart.
Then every rate's arrivals (Poisson, seeded: the same times for both engines) go to it in turn as streaming
`/v1/completions` from a client process (benchmarks/serving_http.py's `timed_run`); the request bodies are the
same bytes for both engines: the same text prompts, greedy, `max_tokens` = --new-tokens, `ignore_eos` (both
servers take it), usage in the last chunk. TTFT, TPOT and their p50 / p99 are benchmarks/serving_report.py's.
Settings are peer_vllm.py's and equal on both (SETTINGS line): dtype, tokens a step, requests a step, page/block
size, prefix caching off, KV room for every request at once, the same cores (TP=1: OMP_NUM_THREADS=cores for
Lockstep, VLLM_CPU_OMP_THREADS_BIND=0-1 for vLLM). Exit status 1 when a server failed or a request did not
complete with exactly its tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # nothing heavy at module level: the spawned client process imports this file

from benchmarks.peer_vllm_env import SPEC, VenvError, ensure_venv  # noqa: E402
from benchmarks.serving_common import NUM_WARM, WARM_TOKENS, say  # noqa: E402
from benchmarks.serving_http import bodies_for, stop_group, stream_one, timed_run, wait_healthy  # noqa: E402
from benchmarks.serving_report import summarize  # noqa: E402

ENGINES = ("lockstep", "vllm")
METRICS = (("TTFT p50", "ttft50"), ("TTFT p99", "ttft99"), ("TPOT p50", "tpot50"), ("TPOT p99", "tpot99"))
BAR = (("ttft99", 0.8), ("tpot99", 0.8))  # issue 35's acceptance: Lockstep / vLLM at most this
LOG_TAIL = 3000  # characters of a failed server's log, in its error
REQUEST_EXTRA = {"ignore_eos": True, "stream_options": {"include_usage": True}}  # on every body, both engines


class ServerStartError(RuntimeError):
    """A server exited or did not answer /health in time; the message names it and holds its log's tail."""


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals at `rate` a second, the first at 0: the same list for both engines (seeded)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def request_bodies(args, texts: list[str], tokens: int) -> list[dict]:
    """The streaming /v1/completions bodies both servers get: serving_http's, greedy, EOS ignored."""
    return bodies_for(args, texts, REQUEST_EXTRA, tokens)


def vllm_command(args, python: str, port: int) -> list[str]:
    """vLLM's OpenAI server with the settings peer_vllm.py states for both engines."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model), "--dtype", args.dtype,
           "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", str(args.tp),
           "--max-num-batched-tokens", str(args.max_batch_tokens), "--max-num-seqs", str(args.max_seqs),
           "--block-size", str(args.page_size), "--max-model-len", str(args.max_model_len), "--seed", str(args.seed),
           "--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching",
           "--uvicorn-log-level", "warning"]
    cmd += ["--enforce-eager"] if args.vllm_enforce_eager else []
    cmd += ["--distributed-executor-backend", "mp"] if args.tp > 1 else []
    return cmd


@contextmanager
def lockstep_server(args, tag: str) -> Iterator[str]:
    """`lockstep serve --tp N --http`, with page size, requests a step and prefix caching as vLLM's; its URL."""
    from benchmarks.serving_common import preset_toml
    from launch.local_server import local_server
    from launch.torchrun import free_port

    listen = f"127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        try:
            server = stack.enter_context(local_server(
                args.model, args.tp, preset_toml(args), extra=["--http", listen], env=args.lockstep_env,
                ready_timeout=args.ready_timeout))
            wait_healthy(f"http://{listen}", server.proc, args.ready_timeout, server.lines, "lockstep serve --http")
        except RuntimeError as e:
            raise ServerStartError(f"Lockstep's server ({tag}) did not start: {e}") from None
        try:
            yield f"http://{listen}"
        finally:
            (args.work / f"{tag}.log").write_text(server.log)


@contextmanager
def vllm_server(args, tag: str) -> Iterator[str]:
    """vLLM's OpenAI server from its venv (cwd: the work dir, so no Lockstep package shadows vLLM's imports);
    its URL. Stopped, with every process it started, when the block ends."""
    from launch.torchrun import free_port

    port = free_port()
    cmd = vllm_command(args, str(args.python), port)
    proc = subprocess.Popen(cmd, env=args.vllm_env, cwd=args.work, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log: list[str] = []
    pump = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)
    pump.start()
    try:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, args.ready_timeout, log, "vLLM's OpenAI server")
        except RuntimeError as e:
            if proc.poll() is not None:
                pump.join(5)  # an exited server's last lines (its traceback) may still be in the pipe
            raise ServerStartError(f"vLLM's server ({tag}: {' '.join(cmd[:3])} ...) did not start: "
                                   f"{str(e).splitlines()[0]}\n" + "".join(log)[-LOG_TAIL:]) from None
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(proc)
        (args.work / f"{tag}.log").write_text("".join(log))


def warm_up(url: str, bodies: list[dict]) -> float:
    """Send `bodies` at once and wait for them all; seconds. RuntimeError if one failed."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        recs = list(pool.map(lambda b: stream_one(url, b, t0), bodies))
    failed = [r["error"] for r in recs if r["error"]]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")
    return time.perf_counter() - t0


def serve_run(args, engine: str, run: int, bodies: list[dict], warm: list[dict],
              arrival_sets: dict[float, list[float]]) -> list[dict]:
    """One server's life: start it, warm it up, send every rate's arrivals in turn. One result a rate, with
    `records` (serving_http's) or `error`."""
    server = lockstep_server if engine == "lockstep" else vllm_server
    base = dict(engine=engine, run=run, tp=args.tp)
    out = []
    say(f"--- run {run}: {engine}")
    t0 = time.monotonic()
    try:
        with server(args, f"run{run}-{engine}") as url:
            base["start_s"] = time.monotonic() - t0
            base["warm_s"] = warm_up(url, warm)
            say(f"  {engine} healthy after {base['start_s']:.1f} s; warm-up {base['warm_s']:.2f} s")
            for rate, arrivals in arrival_sets.items():
                rec = base | {"rate": rate}
                try:
                    rec["records"] = timed_run(args, url, bodies, [], arrivals)
                except RuntimeError as e:
                    rec["error"] = str(e)
                rec["load1"] = os.getloadavg()[0]
                out.append(rec)
                say(f"  {engine} at {rate:g} req/s: " + (rec.get("error") or f"{completed(args, rec)} completed"))
    except RuntimeError as e:  # ServerStartError among them
        say(f"  {engine} FAILED: {e}")
        done = {r["rate"] for r in out}
        out += [base | {"rate": rate, "error": str(e), "load1": os.getloadavg()[0]} for rate in arrival_sets
                if rate not in done]
    return out


def completed(args, result: dict) -> int:
    """Requests that finished without error with exactly --new-tokens tokens."""
    return sum(1 for x in result.get("records", []) if not x.get("error") and x.get("status") == "FINISHED"
               and x.get("n") == args.new_tokens)


def metrics(args, result: dict) -> dict | None:
    """TTFT / TPOT p50 and p99 (ms), tok/s and completed requests of one result; None if it failed."""
    if "error" in result:
        return None
    s = summarize(SimpleNamespace(num_requests=args.num_requests, new_tokens=args.new_tokens), result)
    return {k: s[k] for _, k in METRICS} | {"tps": s["tps"], "completed": completed(args, result)}


def same_texts(a: dict, b: dict) -> int:
    """Requests whose generated text is the same in both results (greedy on both; a random checkpoint's near-tied
    logits may still part float32 sums in different kernels)."""
    return sum(x.get("text") is not None and x.get("text") == y.get("text") for x, y in zip(a["records"], b["records"]))


def summary_rows(args, results: list[dict]) -> list[dict]:
    """One row per rate: each engine's median metrics over its good runs, each run's Lockstep / vLLM ratios
    (lower is better) and their medians, the start and warm-up times, and whether the acceptance bar is met."""
    rows = []
    for rate in dict.fromkeys(r["rate"] for r in results):
        at = [r for r in results if r["rate"] == rate]
        by_run = {(r["run"], r["engine"]): metrics(args, r) for r in at}
        row: dict = {"rate": rate, "errors": [f"{r['engine']} run {r['run']}: {r['error'].splitlines()[0]}"
                                              for r in at if "error" in r]}
        for e in ENGINES:
            good = [m for (_, eng), m in by_run.items() if eng == e and m]
            row[e] = {k: statistics.median(m[k] for m in good) for k in (*(k for _, k in METRICS), "tps")} \
                if good else None
            row[f"{e}_completed"] = [m["completed"] if m else 0 for (_, eng), m in by_run.items() if eng == e]
            row[f"{e}_start_s"] = [r["start_s"] for r in at if r["engine"] == e and "start_s" in r]
            row[f"{e}_warm_s"] = [r["warm_s"] for r in at if r["engine"] == e and "warm_s" in r]
        runs = [n for n in sorted({r["run"] for r in at}) if by_run.get((n, "lockstep")) and by_run.get((n, "vllm"))]
        row["ratios"] = [{k: by_run[(n, "lockstep")][k] / by_run[(n, "vllm")][k] for _, k in METRICS} for n in runs]
        row["same_text"] = [same_texts(*(r for e in ENGINES for r in at if r["run"] == n and r["engine"] == e))
                            for n in runs]
        row["median_ratio"] = {k: statistics.median(x[k] for x in row["ratios"]) for _, k in METRICS} \
            if row["ratios"] else None
        row["meets_bar"] = row["median_ratio"] is not None and all(row["median_ratio"][k] <= v for k, v in BAR)
        rows.append(row)
    return rows


def _cell(x: float | None, width: int = 9, fmt: str = ".1f") -> str:
    return format(x, f">{width}{fmt}") if x is not None else "-".rjust(width)


def table_lines(args, rows: list[dict]) -> list[str]:
    """The table: per rate, each engine's medians (ms), completed requests and start / warm-up seconds, then
    the ratio Lockstep / vLLM of each metric (median over runs) and whether TTFT p99 and TPOT p99 meet 0.8x."""
    done_of = {(id(row), e): "/".join(str(n) for n in row[f"{e}_completed"]) + f" of {args.num_requests}"
               for row in rows for e in ENGINES}  # "32 of 32"; with more runs "32/31/32 of 32"
    wide = max(9, *map(len, done_of.values()))
    lines = [f"{'rate':>5} {'engine':<8} " + " ".join(f"{n:>9}" for n, _ in METRICS)
             + f" {'tok/s':>7} {'done':>{wide}} {'start s':>8} {'warm s':>7}"]
    for row in rows:
        for e in ENGINES:
            m = row[e] or {}
            done = done_of[(id(row), e)]
            start = statistics.median(row[f"{e}_start_s"]) if row[f"{e}_start_s"] else None
            warm = statistics.median(row[f"{e}_warm_s"]) if row[f"{e}_warm_s"] else None
            lines.append(f"{row['rate']:>5g} {e:<8} " + " ".join(_cell(m.get(k)) for _, k in METRICS)
                         + f" {_cell(m.get('tps'), 7)} {done:>{wide}} {_cell(start, 8)} {_cell(warm, 7, '.2f')}")
        r = row["median_ratio"]
        verdict = "meets" if row["meets_bar"] else "misses"
        lines.append(f"{row['rate']:>5g} {'L/V':<8} " + " ".join(
            (f"{r[k]:>8.2f}x" if r else "-".rjust(9)) for _, k in METRICS)
            + f"   {verdict} the bar (TTFT p99 and TPOT p99 <= 0.8x); by run: "
            + ("; ".join(", ".join(f"{x[k]:.2f}" for _, k in METRICS) for x in row["ratios"]) or "-")
            + "; same text by run: " + (", ".join(f"{n}/{args.num_requests}" for n in row["same_text"]) or "-"))
        lines += [f"      error: {e}" for e in row["errors"]]
    return lines


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/small", help="checkpoint with a tokenizer (llama/small made if missing)")
    p.add_argument("--tp", type=int, default=1, choices=[1, 2], help="tensor-parallel size, both engines")
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0], help="request rates (req/s), each run")
    p.add_argument("--runs", type=int, default=None, help="runs, Lockstep then vLLM in each (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help="one run of 16 requests, 32 new tokens each")
    p.add_argument("--num-requests", type=int, default=None, help="requests a rate (default 32; --quick 16)")
    p.add_argument("--min-len", type=int, default=16, help="shortest prompt, tokens")
    p.add_argument("--max-len", type=int, default=128, help="longest prompt, tokens")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens each request generates (default 64; "
                                                                  "--quick 32)")
    p.add_argument("--seed", type=int, default=0, help="prompts' and arrivals' seed")
    from benchmarks.peer_vllm import add_engine_settings  # imports torch: the main process only

    add_engine_settings(p)
    p.add_argument("--venv", default=None, help="vLLM's venv (benchmarks/peer_vllm_env.py's default)")
    p.add_argument("--spec", default=SPEC, help="vLLM's pip spec, if the venv must be made")
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds a server may take to answer /health")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds one rate's requests may take")
    p.add_argument("--work-dir", default=None, help="servers' logs (default: a new temporary folder)")
    p.add_argument("--json", default=None, help="write every request's timestamps and the summary here")
    args = p.parse_args(argv)
    args.runs = (1 if args.quick else 3) if args.runs is None else args.runs
    args.num_requests = (16 if args.quick else 32) if args.num_requests is None else args.num_requests
    args.new_tokens = (32 if args.quick else 64) if args.new_tokens is None else args.new_tokens
    if args.runs < 1 or args.num_requests < 1 or args.new_tokens < 2 or min(args.rates) <= 0:
        p.error("need --runs >= 1, --num-requests >= 1, --new-tokens >= 2 and every rate > 0")
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    args.cores = sorted(os.sched_getaffinity(0))
    if len(args.cores) < args.tp:
        p.error(f"TP={args.tp} needs {args.tp} cores, this process has {len(args.cores)}")
    args.max_requests_per_batch = args.max_seqs  # serving_common.preset_toml's name for it
    return args


def configure(args, cfg: dict) -> None:
    """Both engines' environments and KV room from peer_vllm.py (the offline comparison's, so they match)."""
    from benchmarks import peer_vllm

    w = peer_vllm.Workload("online", "", args.num_requests, args.min_len, args.max_len, args.new_tokens)
    args.num_blocks = peer_vllm.num_blocks(w, args.page_size)
    args.lockstep_env, args.vllm_env = peer_vllm.engine_envs(args, w, args.tp, cfg)
    args.lockstep_env = {"OMP_NUM_THREADS": args.lockstep_env["OMP_NUM_THREADS"]}  # local_server adds os.environ
    args.max_model_len = cfg.get("max_position_embeddings", 2048)
    args.model_samples = False  # every body asks greedy itself; the server's per-request processors are on


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        args.python = ensure_venv(args.venv, args.spec, say=say)
    except VenvError as e:
        say(f"error: no vLLM venv: {e}")
        return 1
    from benchmarks.serving import make_prompts
    from benchmarks.serving_http import text_prompts
    from benchmarks.throughput import ensure_model

    args.model = Path(args.model).resolve()
    ensure_model(args.model)  # llama/small, with a tokenizer, if missing
    cfg = json.loads((args.model / "config.json").read_text())
    configure(args, cfg)
    args.work = Path(args.work_dir or tempfile.mkdtemp(prefix="peer-vllm-serving-"))
    args.work.mkdir(parents=True, exist_ok=True)
    texts, _ = text_prompts(args.model, make_prompts(args, cfg["vocab_size"]))
    bodies = request_bodies(args, texts, args.new_tokens)
    warm = request_bodies(args, texts[:NUM_WARM], WARM_TOKENS)  # as serving.py --http warms up
    arrival_sets = {rate: arrival_times(args.num_requests, rate, args.seed) for rate in args.rates}
    load0 = os.getloadavg()
    say(f"SETTINGS both engines: {args.dtype}, greedy, ignore_eos, {args.new_tokens} new tokens each, "
        f"max_batch_tokens={args.max_batch_tokens}, max requests a step={args.max_seqs}, page/block size="
        f"{args.page_size}, prefix caching {'on' if args.prefix_caching else 'off'}, KV pages {args.num_blocks} "
        f"(vLLM: VLLM_CPU_KVCACHE_SPACE={args.vllm_env['VLLM_CPU_KVCACHE_SPACE']} GiB), TP={args.tp}; Lockstep "
        f"OMP_NUM_THREADS={args.lockstep_env['OMP_NUM_THREADS']}, vLLM VLLM_CPU_OMP_THREADS_BIND="
        f"{args.vllm_env['VLLM_CPU_OMP_THREADS_BIND']}, "
        f"{'eager' if args.vllm_enforce_eager else 'torch.compile (its default)'}")
    say(f"workload: {args.num_requests} text prompts of {args.min_len}-{args.max_len} tokens (seed {args.seed}), "
        f"Poisson arrivals at {', '.join(f'{r:g}' for r in args.rates)} req/s; warm-up {NUM_WARM} x {WARM_TOKENS} "
        f"tokens; {args.runs} run(s); logs in {args.work}; load average {load0[0]:.2f} {load0[1]:.2f} "
        f"{load0[2]:.2f} at start ({os.cpu_count()} cpus)")
    results = []
    for run in range(1, args.runs + 1):
        for engine in ENGINES:
            results += serve_run(args, engine, run, bodies, warm, arrival_sets)
    rows = summary_rows(args, results)
    ok = all("error" not in r and completed(args, r) == args.num_requests for r in results)
    say("\nTTFT / TPOT in ms (median over runs); done: completed requests by run; start s: launch to /health "
        "(load, compile, the engine's own warm-up); warm s: this benchmark's warm-up; L/V: Lockstep / vLLM, "
        "lower is better")
    say("\n".join(table_lines(args, rows)))
    end = os.getloadavg()
    say(f"load average {end[0]:.2f} {end[1]:.2f} {end[2]:.2f} at end; "
        f"{'every request complete' if ok else 'SOME SERVERS FAILED OR REQUESTS WERE INCOMPLETE'}")
    if args.json:
        keep = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list, bool, type(None)))}
        Path(args.json).write_text(json.dumps({"settings": keep, "results": results, "summary": rows}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
