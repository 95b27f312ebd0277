"""Offline throughput: Lockstep's generate_batch against transformers' own, on one random-token workload.

    python benchmarks/throughput.py --model models/small                            # TP=1
    torchrun --nproc-per-node 2 benchmarks/throughput.py --model models/small      # TP=2, every rank runs it

A missing checkpoint is written first by rank 0 (launch.make_model, --arch's small size, seed 0: llama by default;
--arch qwen3_moe makes the MoE benchmark model, 8 experts top-2, about 100M parameters); other ranks wait.
--pairs N (default 3) runs lockstep, transformers, lockstep, transformers ... N pairs in one invocation, each
run loading and freeing its own model, and prints every pair's ratio and their median (the acceptance figure).
Each engine gets a warm-up call (4 short prompts), then one timed generate_batch call on the workload: `wall s`
is that call (manager, KV cache and all, as a user pays it), `setup s` its part before the first forward. EOS is
disabled, so every request must produce exactly --new-tokens tokens: checked, printed, exit status 1 if not.
Both engines get the same ContinuousBatchingConfig fields (--max-batch-tokens, --num-blocks, --page-size; None =
default).

Lockstep's forward-only figures: every ModelRunner.launch(plan) of the timed call is timed and its plan kept,
on every rank (on the CPU, launch runs the forward before it returns; on CUDA it times only the queueing). "execute() in the run" sums rank 0's (plan -> static buffers, sharded forward, logits gather; no
scheduling, sampling or plan broadcast); "replay" runs the kept plans through execute() again back to back on
every rank. Thread settings are only printed (torchrun sets OMP_NUM_THREADS=1). See docs/benchmarks.md.

--model-impl both runs, in each pair, the checkpoint's native family and then the same checkpoint through the
generic path (transformers' modelling code on Lockstep's layers and pages, worker/generic/), prints their ratio and
checks that their tokens are equal; --model-impl generic runs the generic path alone.

On a GPU: --device cuda (the default where CUDA is available), --dtype bfloat16|float32 (both engines get it),
--cuda-graph on|off|auto (both engines' use_cuda_graph). --json PATH writes the results for scripts
(benchmarks/gpu_proof.sh reads it). transformers' config is built through benchmarks/hf_compat.py, so
releases that call the page size `block_size` work too.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.hf_compat import make_cb_config, page_size_of  # noqa: E402

PAGE = 256  # --page-size's default: both engines' default page_size
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def say(*args) -> None:
    if RANK == 0:
        print(*args, flush=True)


def barrier() -> None:
    if WORLD > 1 and dist.is_initialized():
        dist.barrier()


def ensure_model(model_dir: Path, arch: str = "llama", wait_s: float = 900.0) -> None:
    """Rank 0 writes `arch`'s small checkpoint if it is missing (atomically, by rename); the others poll for it."""
    if (model_dir / "config.json").exists():
        return
    if RANK == 0:
        from launch.make_model import make_model

        say(f"no checkpoint in {model_dir}: writing {arch}/small (seed 0)")
        tmp = model_dir.with_name(f"{model_dir.name}.tmp-{os.getpid()}")
        make_model(tmp, arch=arch, size="small", seed=0)
        if model_dir.exists():
            model_dir.rmdir()  # an empty directory is all it can be here; rename cannot replace a full one
        os.rename(tmp, model_dir)
        return
    deadline = time.monotonic() + wait_s
    while not (model_dir / "config.json").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {RANK}: no checkpoint in {model_dir} after {wait_s:.0f}s")
        time.sleep(0.5)


def make_prompts(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_prompts)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def gen_config(max_new_tokens: int):
    """Greedy, EOS disabled (-1 is never sampled) so that every request runs to max_new_tokens; both engines
    treat eos_token_id=-1 as "no EOS" (transformers itself replaces None with -1)."""
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max_new_tokens)


def timed_call(model, prompts, args, cb_config, first_forward: list) -> tuple[dict, float, float]:
    """One generate_batch call, bracketed by barriers; returns (outputs, wall s, setup s)."""
    barrier()
    first_forward.clear()
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=gen_config(args.new_tokens),
                               continuous_batching_config=cb_config(), max_new_tokens=args.new_tokens)
    wall = time.perf_counter() - t0
    barrier()
    setup = (first_forward[0] - t0) if first_forward else float("nan")
    return out, wall, setup


def run_lockstep(args, prompts, warm, impl: str = "auto") -> dict:
    """`impl`: cluster.load's model_impl; "generic" runs the checkpoint through transformers' modelling code on
    Lockstep's layers and pages (worker/generic/), reported as engine lockstep-generic."""
    import cluster
    from worker.runner import ModelRunner

    t_load = time.perf_counter()
    model = cluster.load(args.model, dtype=args.dtype, device=args.device, model_impl=impl)
    t_warm = time.perf_counter()
    rec = {"on": False, "plans": [], "times": [], "runner": None}
    first_forward: list[float] = []
    original = ModelRunner.launch

    def recording_launch(self, plan):
        t0 = time.perf_counter()
        if not first_forward:
            first_forward.append(t0)
        out = original(self, plan)
        if rec["on"]:
            rec["times"].append(time.perf_counter() - t0)
            rec["plans"].append(plan)
            rec["runner"] = self
        return out

    cb = lambda: cluster.ContinuousBatchingConfig(max_batch_tokens=args.max_batch_tokens,  # noqa: E731
                                                  num_blocks=args.num_blocks, page_size=args.page_size,
                                                  use_cuda_graph=args.use_cuda_graph,
                                                  default_compile_level=args.compile_level,
                                                  max_requests_per_batch=args.max_requests_per_batch,
                                                  allow_block_sharing=not args.no_prefix_caching)

    ModelRunner.launch = recording_launch
    try:
        model.generate_batch(warm, generation_config=gen_config(8), continuous_batching_config=cb(),
                             max_new_tokens=8)
        load_warm = (t_warm - t_load, time.perf_counter() - t_warm)  # cluster.load, then the warm-up call
        rec["on"] = True
        out, wall, setup = timed_call(model, prompts, args, cb, first_forward)
        rec["on"] = False
    finally:
        ModelRunner.launch = original
    # Replay: the same plans, back to back, on every rank (the runner and its cache outlive the manager here).
    runner, plans = rec["runner"], rec["plans"]
    barrier()
    t0 = time.perf_counter()
    for plan in ([] if args.no_replay else plans):
        runner.execute(plan)
    replay = float("nan") if args.no_replay else time.perf_counter() - t0
    barrier()
    rc = runner.rc
    result = dict(engine="lockstep-generic" if impl == "generic" else "lockstep", counts=[len(o.generated_tokens) for o in out.values()], wall=wall, setup=setup,
                  tokens=[list(o.generated_tokens) for o in out.values()], notes=list(rc.notes),
                  threads=torch.get_num_threads(), steps=len(plans), exec_s=sum(rec["times"]), replay_s=replay,
                  query_tokens=sum(int(p.q_lens.sum()) for p in plans), load_s=load_warm[0], warm_s=load_warm[1],
                  config=f"max_batch_tokens={rc.max_batch_tokens} max_requests_per_batch={rc.max_requests_per_batch} "
                         f"num_blocks={rc.num_blocks} page_size={rc.page_size} q_padding={rc.q_padding} "
                         f"kv_padding={rc.kv_padding}")
    del out, model, runner, plans, rec
    gc.collect()
    return result


def run_transformers(args, prompts, warm) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    # its INFO lines (cache sizing, chosen paths) with BENCH_DEBUG=1; otherwise errors only
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.INFO if os.environ.get("BENCH_DEBUG")
                                                           else logging.ERROR)
    kwargs = {"dtype": getattr(torch, args.dtype)}
    if WORLD > 1:  # tp_plan="auto", in the spelling that does not warn about deprecation
        kwargs["distributed_config"] = transformers.DistributedConfig(tp_plan="auto")
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
    if WORLD == 1:
        model = model.to(args.device)
    first_forward: list[float] = []
    hook = model.register_forward_pre_hook(
        lambda *_: first_forward.append(time.perf_counter()) if not first_forward else None)

    # only the fields asked for: make_cb_config refuses a field the installed release lacks, by name
    extra = {k: v for k, v in (("allow_block_sharing", False if args.no_prefix_caching else None),
                               ("max_requests_per_batch", args.max_requests_per_batch)) if v is not None}
    cb = lambda: make_cb_config(transformers.ContinuousBatchingConfig, page_size=args.page_size,  # noqa: E731
                                max_batch_tokens=args.max_batch_tokens, num_blocks=args.num_blocks,
                                use_cuda_graph=args.use_cuda_graph, **extra)

    managers = []  # to report the config the manager resolved (its defaults filled in)
    init = model.init_continuous_batching
    model.init_continuous_batching = lambda *a, **k: managers.append(init(*a, **k)) or managers[-1]
    model.generate_batch(warm, generation_config=gen_config(8), continuous_batching_config=cb(), max_new_tokens=8)
    out, wall, setup = timed_call(model, prompts, args, cb, first_forward)
    hook.remove()
    c = managers[-1].continuous_batching_config
    note = (f"max_batch_tokens={c.max_batch_tokens} max_requests_per_batch={c.max_requests_per_batch} "
            f"num_blocks={c.num_blocks} page_size={page_size_of(c)} attn={model.config._attn_implementation}")
    result = dict(engine="transformers", counts=[len(o.generated_tokens) for o in out.values()], wall=wall, setup=setup,
                  tokens=[list(o.generated_tokens) for o in out.values()],
                  threads=torch.get_num_threads(), config=note)
    del out, model, managers, init, c
    gc.collect()
    return result


def ratios(pairs: list[list[dict]], engine: str = "lockstep", against: str = "transformers") -> list[float]:
    """Each pair's `engine`/`against` throughput ratio (pairs without both are left out)."""
    found = []
    for pair in pairs:
        by = {r["engine"]: r for r in pair}
        if engine in by and against in by:
            found.append(sum(by[engine]["counts"]) / by[engine]["wall"]
                         / (sum(by[against]["counts"]) / by[against]["wall"]))
    return found


def report(args, pairs: list[list[dict]]) -> bool:
    """Print the table and notes on rank 0; True when every request produced exactly --new-tokens tokens (and the
    generic path the native one's tokens, where a pair ran both)."""
    say(f"\nworkload: {args.num_prompts} prompts, lengths U[{args.min_len}, {args.max_len}] (seed {args.seed}), "
        f"{args.new_tokens} new tokens each, greedy, EOS disabled; both configs get "
        f"max_batch_tokens={args.max_batch_tokens} num_blocks={args.num_blocks} page_size={args.page_size} "
        f"(None = each engine's default)")
    say(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}, cpus={os.cpu_count()}, load average "
        f"(1 min) {args.load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end; {len(pairs)} pair(s), "
        f"run alternately\n")
    say(f"{'pair':>4} {'engine':<16} {'TP':>2} {'requests':>8} {'gen tokens':>10} {'wall s':>8} {'setup s':>8} "
        f"{'tok/s':>8} {'threads':>7}")
    for i, pair in enumerate(pairs):
        for r in pair:
            tokens = sum(r["counts"])
            r["tps"] = tokens / r["wall"]
            say(f"{i + 1:>4} {r['engine']:<16} {WORLD:>2} {len(r['counts']):>8} {tokens:>10} {r['wall']:>8.2f} "
                f"{r['setup']:>8.2f} {r['tps']:>8.1f} {r['threads']:>7}")
    say("")
    all_exact = True
    for i, pair in enumerate(pairs):
        for r in pair:
            c = r["counts"]
            exact = all(n == args.new_tokens for n in c) and len(c) == args.num_prompts
            all_exact &= exact
            if i == 0 or not exact:
                say(f"{r['engine']}: tokens per request min {min(c)} max {max(c)} over {len(c)} requests "
                    f"({'all exactly' if exact else 'NOT all'} {args.new_tokens}); {r['config']}")
    for i, pair in enumerate(pairs):  # the generic path runs the same checkpoint: the same greedy tokens
        by = {r["engine"]: r for r in pair}
        if "lockstep" in by and "lockstep-generic" in by:
            same = by["lockstep"]["tokens"] == by["lockstep-generic"]["tokens"]
            all_exact &= same
            say(f"pair {i + 1}: lockstep-generic's tokens {'equal' if same else 'DIFFER FROM'} lockstep's")
    for name, found in (("lockstep/transformers", ratios(pairs)),
                        ("lockstep-generic/lockstep", ratios(pairs, "lockstep-generic", "lockstep"))):
        if found:
            say(f"ratio {name} by pair: " + ", ".join(f"{x:.2f}x" for x in found))
            say(f"median ratio over {len(found)} pair(s): {statistics.median(found):.2f}x")
    for i, pair in enumerate(pairs):
        for r in (x for x in pair if x["engine"].startswith("lockstep")):
            tokens = sum(r["counts"])
            say(f"pair {i + 1}: {r['engine']} forward-only ({r['steps']} execute() calls, {r['query_tokens']} query "
                f"tokens):")
            say(f"  execute() in the run, rank 0: {r['exec_s']:.2f} s = {100 * r['exec_s'] / r['wall']:.0f}% of "
                f"wall -> {tokens / r['exec_s']:.1f} tok/s if nothing else took time")
            if not math.isnan(r["replay_s"]):  # --no-replay
                say(f"  replay of the same plans    : {r['replay_s']:.2f} s -> {tokens / r['replay_s']:.1f} tok/s "
                    f"(pad into static buffers + sharded forward + logits gather, back to back)")
    return all_exact


def median_pair(pairs: list[list[dict]]) -> list[dict]:
    """The pair whose ratio is the median (the lower middle one for an even count); the first without ratios."""
    found = ratios(pairs)
    if len(found) != len(pairs) or not found:
        return pairs[0]
    order = sorted(range(len(found)), key=found.__getitem__)
    return pairs[order[(len(order) - 1) // 2]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory (made if missing)")
    p.add_argument("--arch", default="llama", help="the architecture of a checkpoint made where --model is missing "
                   "(launch.make_model's ARCHS, small size), e.g. qwen3_moe")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--pairs", type=int, default=3,
                   help="runs of lockstep then transformers, alternating; prints each pair's ratio and the median")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda:LOCAL_RANK where CUDA is available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="both engines' dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--cuda-graph", default="auto", choices=["on", "off", "auto"],
                   help="both engines' use_cuda_graph (auto: None, each engine decides)")
    p.add_argument("--json", default=None, help="write the results (rates, token counts, tokens) to this file")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="passed to both engines' ContinuousBatchingConfig (default: each engine's own)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV pages of --page-size tokens, passed to both engines (default: enough for every request at "
                        "once; 0: each engine's own default, which for transformers on CPU is 60%% of RAM per rank)")
    p.add_argument("--max-requests-per-batch", type=int, default=None,
                   help="passed to both engines' ContinuousBatchingConfig (default: each engine's own)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="both engines' allow_block_sharing=False (no prefix cache)")
    p.add_argument("--no-replay", action="store_true", help="skip the replay of Lockstep's plans after its timed run")
    p.add_argument("--page-size", type=int, default=PAGE,
                   help="tokens a KV page, passed to both engines' ContinuousBatchingConfig (vLLM's default: 16)")
    p.add_argument("--cpu-offload", type=float, default=None, metavar="GIB",
                   help="instead of the comparison: Lockstep with cpu_offload_space 0 and GIB under --num-blocks "
                        "(benchmarks/offload_report.py)")
    p.add_argument("--model-impl", default="auto", choices=["auto", "native", "generic", "both"],
                   help="Lockstep's model_impl (cluster.load); both: each pair runs the native family, then the same "
                        "checkpoint through the generic path (transformers' modelling code, worker/generic/)")
    p.add_argument("--compile-level", type=int, default=0, choices=[0, 1, 2, 3],
                   help="Lockstep's default_compile_level (its warm-up call compiles; transformers runs eagerly)")
    args = p.parse_args()
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    if args.pairs < 1:
        p.error("need --pairs >= 1")

    if args.device is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        args.device = f"cuda:{local % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.use_cuda_graph = {"on": True, "off": False, "auto": None}[args.cuda_graph]
    args.load_before = os.getloadavg()[0]  # other busy processes distort CPU timings badly; shown with them
    if args.num_blocks is None:
        args.num_blocks = args.num_prompts * math.ceil((args.max_len + args.new_tokens) / args.page_size)
    args.num_blocks = args.num_blocks or None
    model_dir = Path(args.model)
    ensure_model(model_dir, args.arch)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args, vocab)
    warm = [x[:args.min_len] for x in prompts[:4]]
    say(f"rank 0 of {WORLD}: torch {torch.__version__}, torch threads {torch.get_num_threads()}, device {args.device}, "
        f"dtype {args.dtype}, cuda graphs {args.cuda_graph}")

    if args.cpu_offload is not None:
        from benchmarks.offload_report import run_offload_report
        return run_offload_report(args, prompts, warm, say, barrier, gen_config)
    pairs = []
    for _ in range(args.pairs):  # each engine's models are freed before the other's run
        impls = ("native", "generic") if args.model_impl == "both" else (args.model_impl,)
        pair = [run_lockstep(args, prompts, warm, impl) for impl in impls]
        if not args.skip_transformers:
            pair.append(run_transformers(args, prompts, warm))
        pairs.append(pair)
    ok = report(args, pairs)
    if args.json and RANK == 0:  # "results": the median pair's runs (what benchmarks/gpu_summary.py reads)
        found = ratios(pairs)
        Path(args.json).write_text(json.dumps({
            "tp": WORLD, "device": args.device, "dtype": args.dtype, "cuda_graph": args.cuda_graph, "all_exact": ok,
            "results": median_pair(pairs), "pairs": pairs, "ratios": found,
            "median_ratio": statistics.median(found) if found else None}))
    barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
