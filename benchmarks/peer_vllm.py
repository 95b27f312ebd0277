"""Peer benchmark: Lockstep's offline generate_batch against vLLM's CPU build, side by side in one run, as ratios.

    python benchmarks/peer_vllm_env.py                                   # once: vLLM's venv (a few GB)
    python benchmarks/peer_vllm.py --model models/small --tp 1 2         # three pairs a workload, both TPs
    python benchmarks/peer_vllm.py --model models/small --quick          # the small smoke version, one pair

Every run is a process of its own, started from here (this process runs no model): Lockstep's is
benchmarks/throughput.py with --skip-transformers --pairs 1 --json (under torchrun at TP=2), vLLM's is
benchmarks/peer_vllm_worker.py in vLLM's venv, JSON in and out. For each TP and workload the runs alternate,
Lockstep then vLLM, --pairs times; each pair's ratio is Lockstep's generated tokens/s over vLLM's, in each
engine's one timed call (after its model load and a warm-up call, both timed apart). Both get the same token-id
prompts (throughput.make_prompts), greedy, EOS ignored, and the same settings (SETTINGS in the output: dtype,
token budget a step, requests a step, page/block size, prefix caching off, KV room for every request at once,
threads). Their tokens are compared request by request: mismatches are counted, not fatal (float sums differ
between the engines' kernels). Exit status 1 when a run failed or a request did not get exactly its tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.peer_vllm_env import SPEC, VenvError, ensure_venv  # noqa: E402
from benchmarks.product_ceiling import ROWS, ceiling_lines, product_rate, product_weights, workload_flops  # noqa: E402
from benchmarks.throughput import ensure_model, make_prompts  # noqa: E402
from launch.torchrun import torchrun_command  # noqa: E402
from worker import kv_cache  # noqa: E402

WORKER = ROOT / "benchmarks" / "peer_vllm_worker.py"
WARM_PROMPTS, WARM_NEW_TOKENS = 4, 8  # throughput.py's warm-up: the first 4 prompts cut to --min-len, 8 tokens
TAIL_LINES = 30  # of a failed run's log, printed


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    num_prompts: int
    min_len: int
    max_len: int
    new_tokens: int


WORKLOADS = {
    "a": Workload("a", "many short prompts, short outputs", 64, 16, 128, 64),
    "b": Workload("b", "long prompts, short outputs", 48, 100, 400, 32),
    "c": Workload("c", "short prompts, long outputs (decode-heavy)", 256, 16, 32, 256),
}
QUICK = {
    "a": Workload("a", "many short prompts, short outputs", 16, 16, 64, 16),
    "b": Workload("b", "long prompts, short outputs", 8, 100, 200, 8),
    "c": Workload("c", "short prompts, long outputs (decode-heavy)", 32, 8, 16, 64),
}


class PeerRunError(RuntimeError):
    """One engine run failed; the message holds why (the worker's traceback or the tail of the run's log)."""


def workload_prompts(w: Workload, seed: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, warm-up prompts): throughput.py's own, so the Lockstep run it starts draws the same ones."""
    prompts = make_prompts(SimpleNamespace(seed=seed, min_len=w.min_len, max_len=w.max_len,
                                           num_prompts=w.num_prompts), vocab)
    return prompts, [x[:w.min_len] for x in prompts[:WARM_PROMPTS]]


def num_blocks(w: Workload, page: int) -> int:
    """Pages for every request at once (throughput.py's default)."""
    return w.num_prompts * math.ceil((w.max_len + w.new_tokens) / page)


def kv_bytes_per_token(cfg: dict, dtype: str) -> int:
    """One token's K and V over every layer (worker/kv_cache.py's count), from a checkpoint's config.json."""
    heads = cfg["num_attention_heads"]
    return kv_cache.kv_bytes_per_token(cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads),
                                       cfg.get("head_dim") or cfg["hidden_size"] // heads, getattr(torch, dtype))


def kvcache_gib(w: Workload, page: int, cfg: dict, dtype: str) -> int:
    """VLLM_CPU_KVCACHE_SPACE (whole GiB, a rank): room for the pages Lockstep gets, rounded up."""
    return max(1, math.ceil(num_blocks(w, page) * page * kv_bytes_per_token(cfg, dtype) / 2**30))


def cpu_ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out, start = [], None
    for i, c in enumerate(cores):
        start = c if start is None else start
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            out.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(out)


def cpu_binds(cores: list[int], tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND: the cores split in `tp` equal runs, one a rank, "|" between ranks."""
    cores = sorted(cores)
    if len(cores) < tp:
        raise ValueError(f"{len(cores)} cores for TP={tp}")
    n = len(cores) // tp
    return "|".join(cpu_ranges(cores[r * n:(r + 1) * n]) for r in range(tp))


def lockstep_command(args, w: Workload, tp: int, json_path: Path) -> list[str]:
    flags = ["--model", str(args.model), "--skip-transformers", "--pairs", "1", "--no-replay", "--json",
             str(json_path), "--device", "cpu", "--dtype", args.dtype, "--num-prompts", str(w.num_prompts),
             "--min-len", str(w.min_len), "--max-len", str(w.max_len), "--new-tokens", str(w.new_tokens),
             "--seed", str(args.seed), "--max-batch-tokens", str(args.max_batch_tokens),
             "--max-requests-per-batch", str(args.max_seqs), "--page-size", str(args.page_size),
             "--num-blocks", str(num_blocks(w, args.page_size)), "--compile-level", str(args.compile_level)]
    flags += [] if args.prefix_caching else ["--no-prefix-caching"]
    if tp == 1:
        return [sys.executable, "-m", "benchmarks.throughput", *flags]
    return torchrun_command(tp, "benchmarks.throughput", flags)


def vllm_request(args, w: Workload, tp: int, prompts, warm, cfg: dict) -> dict:
    return dict(model=str(Path(args.model).resolve()), prompts=prompts, warm=warm, new_tokens=w.new_tokens,
                warm_new_tokens=WARM_NEW_TOKENS, tp=tp, dtype=args.dtype, max_batch_tokens=args.max_batch_tokens,
                max_seqs=args.max_seqs, block_size=args.page_size, prefix_caching=args.prefix_caching,
                enforce_eager=args.vllm_enforce_eager, max_model_len=cfg.get("max_position_embeddings", 2048),
                seed=args.seed)


def engine_envs(args, w: Workload, tp: int, cfg: dict) -> tuple[dict, dict]:
    """(Lockstep's, vLLM's) environment: the same threads a rank; vLLM's KV room and core binding."""
    threads = len(args.cores) // tp
    lockstep = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    vllm = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONPATH")}
    vllm.update(VLLM_CPU_KVCACHE_SPACE=str(kvcache_gib(w, args.page_size, cfg, args.dtype)),
                VLLM_CPU_OMP_THREADS_BIND=cpu_binds(args.cores, tp))
    return lockstep, vllm


def run_process(cmd: list[str], env: dict, log: Path, timeout: float) -> float:
    """Run `cmd` in its own session, output to `log`; its seconds. PeerRunError (with the log's tail) on a
    non-zero exit or a time-out (the whole session is killed then)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = f"killed after {timeout:.0f} s"
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-TAIL_LINES:])
        raise PeerRunError(f"exit status {code}: {' '.join(cmd[:4])} ... (log {log}):\n{tail}")
    return time.perf_counter() - t0


def run_lockstep(args, w: Workload, tp: int, work: Path, tag: str) -> dict:
    out = work / f"{tag}-lockstep.json"
    env, _ = engine_envs(args, w, tp, args.cfg)
    took = run_process(lockstep_command(args, w, tp, out), env, work / f"{tag}-lockstep.log", args.timeout)
    r = json.loads(out.read_text())["results"][0]
    return dict(engine="lockstep", counts=r["counts"], tokens=r["tokens"], wall=r["wall"], load_s=r["load_s"],
                warm_s=r["warm_s"], setup_s=r["setup"], process_s=took, config=r["config"], threads=r["threads"])


def run_vllm(args, w: Workload, tp: int, prompts, warm, work: Path, tag: str) -> dict:
    req, res = work / f"{tag}-vllm-request.json", work / f"{tag}-vllm-result.json"
    req.write_text(json.dumps(vllm_request(args, w, tp, prompts, warm, args.cfg)))
    _, env = engine_envs(args, w, tp, args.cfg)
    res.unlink(missing_ok=True)
    try:
        took = run_process([str(args.python), str(WORKER), str(req), str(res)], env, work / f"{tag}-vllm.log",
                           args.timeout)
    except PeerRunError as e:
        error = json.loads(res.read_text()).get("error") if res.exists() else None
        raise PeerRunError(f"{e}\n{error}" if error else str(e)) from None  # the log's tail, then the traceback
    r = json.loads(res.read_text())
    return dict(engine="vllm", counts=r["counts"], tokens=r["tokens"], wall=r["wall"], load_s=r["load_s"],
                warm_s=r["warm_s"], setup_s=None, process_s=took, config=r["config"], version=r["version"],
                threads=len(args.cores) // tp)


def mismatches(a: list[list[int]], b: list[list[int]]) -> tuple[int, int | None]:
    """(requests whose tokens differ, the earliest token index where any differs; None when all are equal)."""
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t)))
             for s, t in zip(a, b) if s != t]
    return len(first) + abs(len(a) - len(b)), min(first) if first else None


def last_line(text: str) -> str:
    """A traceback's last non-empty line: the exception and its message."""
    return next((x for x in reversed(text.splitlines()) if x.strip()), text).strip()


def tps(run: dict) -> float:
    return sum(run["counts"]) / run["wall"]


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (workload, TP), in first-seen order: each engine's median tok/s, every complete pair's
    Lockstep/vLLM ratio, their median, token mismatches a pair, and the runs' errors."""
    groups: dict[tuple, dict[int, dict]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["tp"]), {}).setdefault(r["pair"], {})[r["engine"]] = r
    rows = []
    for (name, tp), pairs in groups.items():
        ok = {e: [p[e] for p in pairs.values() if e in p and "error" not in p[e]] for e in ("lockstep", "vllm")}
        complete = [p for p in pairs.values() if all(e in p and "error" not in p[e] for e in ("lockstep", "vllm"))]
        found = [tps(p["lockstep"]) / tps(p["vllm"]) for p in complete]
        rows.append(dict(
            workload=name, tp=tp,
            lockstep_tps=statistics.median(map(tps, ok["lockstep"])) if ok["lockstep"] else None,
            vllm_tps=statistics.median(map(tps, ok["vllm"])) if ok["vllm"] else None,
            lockstep_wall=statistics.median(r["wall"] for r in ok["lockstep"]) if ok["lockstep"] else None,
            vllm_wall=statistics.median(r["wall"] for r in ok["vllm"]) if ok["vllm"] else None,
            ratios=found, median_ratio=statistics.median(found) if found else None,
            mismatches=[mismatches(p["lockstep"]["tokens"], p["vllm"]["tokens"]) for p in complete],
            errors=[f"{e} pair {i}: {last_line(p[e]['error'])}"
                    for i, p in pairs.items() for e in p if "error" in p[e]]))
    return rows


def _num(x, fmt: str) -> str:
    """`x` in `fmt`; None as "-" in the same width."""
    return format(x, fmt) if x is not None else "-".rjust(int(fmt.split(".")[0] or 0))


def run_lines(runs: list[dict]) -> list[str]:
    lines = [f"{'wl':<2} {'TP':>2} {'pair':>4} {'engine':<8} {'reqs':>4} {'tokens':>6} {'load s':>7} {'warm s':>7} "
             f"{'setup s':>7} {'wall s':>7} {'tok/s':>7} {'proc s':>7} {'load1':>5}"]
    for r in runs:
        if "error" in r:
            lines.append(f"{r['workload']:<2} {r['tp']:>2} {r['pair']:>4} {r['engine']:<8} FAILED (below)")
            continue
        lines.append(f"{r['workload']:<2} {r['tp']:>2} {r['pair']:>4} {r['engine']:<8} {len(r['counts']):>4} "
                     f"{sum(r['counts']):>6} {r['load_s']:>7.1f} {r['warm_s']:>7.2f} {_num(r['setup_s'], '7.2f')} "
                     f"{r['wall']:>7.2f} {tps(r):>7.1f} {r['process_s']:>7.1f} {r['load1']:>5.2f}")
    return lines


def summary_lines(rows: list[dict]) -> list[str]:
    lines = [f"{'wl':<2} {'TP':>2} {'lockstep tok/s':>14} {'vllm tok/s':>10} {'median L/V':>10}  ratios by pair, "
             f"token mismatches by pair (requests, first index)"]
    for s in rows:
        by = ", ".join(f"{x:.2f}x" for x in s["ratios"]) or "-"
        mm = ", ".join(f"{n}" + (f" (from token {i})" if i is not None else "") for n, i in s["mismatches"]) or "-"
        ratio = "-" if s["median_ratio"] is None else f"{s['median_ratio']:.2f}x"
        lines.append(f"{s['workload']:<2} {s['tp']:>2} {_num(s['lockstep_tps'], '14.1f')} "
                     f"{_num(s['vllm_tps'], '10.1f')} {ratio:>10}  {by}; {mm}")
        lines += [f"   {e}" for e in s["errors"]]
    return lines


def add_engine_settings(p: argparse.ArgumentParser) -> None:
    """The settings both engines take alike (docs/benchmarks.md, "Settings"): also peer_vllm_serving.py's."""
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens a step, both engines")
    p.add_argument("--max-seqs", type=int, default=256, help="requests a step (max_num_seqs), both engines")
    p.add_argument("--page-size", type=int, default=128, help="KV page (vLLM: block) size in tokens, both engines")
    p.add_argument("--prefix-caching", action="store_true", help="leave both engines' prefix caches on")
    p.add_argument("--vllm-enforce-eager", action="store_true", help="vLLM without torch.compile")


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/small", help="checkpoint directory (llama/small made if missing)")
    p.add_argument("--tp", type=int, nargs="+", default=[1], choices=[1, 2], help="tensor-parallel sizes to run")
    p.add_argument("--workloads", default="abc", help="which of a, b, c to run (default all)")
    p.add_argument("--quick", action="store_true", help="the small versions of the workloads, one pair")
    p.add_argument("--pairs", type=int, default=None, help="Lockstep, vLLM runs alternating (default 3; --quick 1)")
    p.add_argument("--seed", type=int, default=0)
    add_engine_settings(p)
    p.add_argument("--compile-level", type=int, default=0, choices=[0, 1, 2, 3], help="Lockstep's compile level")
    p.add_argument("--venv", default=None, help="vLLM's venv (benchmarks/peer_vllm_env.py's default)")
    p.add_argument("--spec", default=SPEC, help="vLLM's pip spec, if the venv must be made")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one engine run may take")
    p.add_argument("--work-dir", default=None, help="requests, results and logs (default: a new temporary one)")
    p.add_argument("--json", default=None, help="write every run and the summary here")
    args = p.parse_args(argv)
    bad = sorted(set(args.workloads) - set(WORKLOADS))
    if bad or not args.workloads:
        p.error(f"--workloads takes letters of {''.join(WORKLOADS)}, got {args.workloads!r}")
    args.pairs = (1 if args.quick else 3) if args.pairs is None else args.pairs
    if args.pairs < 1:
        p.error("need --pairs >= 1")
    args.cores = sorted(os.sched_getaffinity(0))
    for tp in args.tp:
        if len(args.cores) < tp:
            p.error(f"TP={tp} needs {tp} cores, this process has {len(args.cores)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    try:
        args.python = ensure_venv(args.venv, args.spec, say=say)
    except VenvError as e:
        say(f"error: no vLLM venv: {e}")
        return 1
    ensure_model(Path(args.model))
    args.cfg = json.loads((Path(args.model) / "config.json").read_text())
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="peer-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    table = QUICK if args.quick else WORKLOADS
    load_start = os.getloadavg()
    say(f"SETTINGS both engines: {args.dtype}, greedy, EOS ignored, max_batch_tokens={args.max_batch_tokens}, "
        f"max requests a step={args.max_seqs}, page/block size={args.page_size}, prefix caching "
        f"{'on' if args.prefix_caching else 'off'}, KV room for every request at once; {len(args.cores)} cores "
        f"{cpu_ranges(args.cores)}: TP=1 one process of {len(args.cores)} threads, TP=2 two of "
        f"{len(args.cores) // 2}; vLLM {'eager' if args.vllm_enforce_eager else 'torch.compile (its default)'}, "
        f"Lockstep compile level {args.compile_level}; work dir {work}")
    say(f"load average {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} at start")
    runs: list[dict] = []
    weights, tflop = product_weights(args.model), {}  # docs/benchmarks.md, "The product ceiling"
    for tp in args.tp:
        for w in (table[k] for k in args.workloads):
            prompts, warm = workload_prompts(w, args.seed, args.cfg["vocab_size"])
            if weights is not None:
                tflop[w.name] = workload_flops([len(x) for x in prompts], w.new_tokens, weights) / 1e12
            _, venv = engine_envs(args, w, tp, args.cfg)
            say(f"\nTP={tp} workload {w.name}: {w.what}: {w.num_prompts} prompts of {w.min_len}-{w.max_len} tokens, "
                f"{w.new_tokens} new each; VLLM_CPU_KVCACHE_SPACE={venv['VLLM_CPU_KVCACHE_SPACE']} "
                f"VLLM_CPU_OMP_THREADS_BIND={venv['VLLM_CPU_OMP_THREADS_BIND']}")
            for pair in range(1, args.pairs + 1):
                for engine in ("lockstep", "vllm"):
                    tag = f"tp{tp}-{w.name}-{pair}"
                    rec = dict(workload=w.name, tp=tp, pair=pair, engine=engine)
                    try:
                        rec.update(run_lockstep(args, w, tp, work, tag) if engine == "lockstep"
                                   else run_vllm(args, w, tp, prompts, warm, work, tag))
                        rec["exact"] = len(rec["counts"]) == w.num_prompts and set(rec["counts"]) == {w.new_tokens}
                    except PeerRunError as e:
                        rec["error"] = str(e)
                        say(f"  {engine} FAILED at TP={tp}:\n{e}")
                    rec["load1"] = os.getloadavg()[0]
                    runs.append(rec)
                    if "error" not in rec:
                        say(f"  pair {pair} {engine:<8} {tps(rec):7.1f} tok/s (wall {rec['wall']:.2f} s, load "
                            f"{rec['load_s']:.1f} s, warm {rec['warm_s']:.2f} s, process {rec['process_s']:.1f} s"
                            f"{'' if rec['exact'] else ', NOT every request got exactly its tokens'})")
    rows = summarize(runs)
    ok = all("error" not in r and r["exact"] for r in runs)
    say("\n" + "\n".join(run_lines(runs)))
    say("\n" + "\n".join(summary_lines(rows)))
    if weights is not None:
        for r in rows:
            r["tflop"] = tflop[r["workload"]]
        rate = product_rate(args.cfg["hidden_size"], args.cfg["intermediate_size"], len(args.cores))
        say(f"\nthe product ceiling: this machine's float32 product, {ROWS} x {args.cfg['hidden_size']} by "
            f"{args.cfg['intermediate_size']} x {args.cfg['hidden_size']} on {len(args.cores)} threads, "
            f"{rate:.0f} GFLOP/s; each engine's product GFLOP/s (share of it); the most L/V any engine could reach")
        say("\n".join(ceiling_lines(rows, rate)))
    versions = {r["engine"]: r.get("version") for r in runs if "error" not in r}
    say(f"\nvLLM {versions.get('vllm', '?')}; configs: " + "; ".join(
        f"{r['engine']}: {r['config']}" for r in {r['engine']: r for r in runs if 'error' not in r}.values()))
    end = os.getloadavg()
    say(f"load average {end[0]:.2f} {end[1]:.2f} {end[2]:.2f} at end ({os.cpu_count()} cpus); "
        f"{'all runs complete and exact' if ok else 'SOME RUNS FAILED OR WERE NOT EXACT'}")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "cfg"} | {"python": str(args.python)}
        Path(args.json).write_text(json.dumps({"settings": settings, "runs": runs, "summary": rows,
                                               "workloads": {k: asdict(table[k]) for k in args.workloads}}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
