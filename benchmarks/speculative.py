"""Speculative decoding (n-gram) against plain decoding, side by side in one run, on a workload where proposals can
hit and one where they cannot (TP=1, in this process; docs/speculative.md).

    python benchmarks/speculative.py [--model models/tiny-llama] [--prompts 4] [--new-tokens 96] [--k 4] [--runs 1]
                                     [--draft DIR] [--no-transformers]

Workloads: `repeat` decodes greedily, and a random checkpoint's greedy output falls into loops within a few tokens
(a copy or edit task repeats its input in the same way), so proposals hit; `random` samples at temperature 1 with a
seed per request, so the output does not repeat and proposals miss (the proposer backs off: speculation.py).
EOS is off, so every request writes exactly --new-tokens tokens (checked) and the two modes write the same tokens
(checked: speculative decoding is exact). For each workload and mode: `batch 1` runs the prompts one at a time (decode
tokens/s of one request), `batch N` all at once (whole-batch tokens/s); the ratio columns are against plain.
`--draft DIR`: the draft-model proposer too (a small checkpoint with the model's vocabulary). transformers' own
`generate` runs the same prompts at batch 1 as a reference (`--no-transformers` to skip): plain, with prompt lookup
(`prompt_lookup_num_tokens`) and, with --draft, assisted generation (`assistant_model`). A missing checkpoint is
made first (llama, tiny, seed 0). Do not quote figures from a loaded machine."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKLOADS = ("repeat", "random")


def sampling(workload: str, i: int) -> dict:
    return {} if workload == "repeat" else {"do_sample": True, "temperature": 1.0, "seed": i}


def run(model, workload: str, mode: str, prompts: list[list[int]], args: argparse.Namespace,
        together: bool) -> tuple[float, list[list[int]], dict]:
    """(wall seconds, tokens per prompt, the engine's spec stats) of the prompts one at a time or all together."""
    import cluster

    spec = ({"method": "ngram", "num_speculative_tokens": args.k} if mode == "ngram" else
            {"method": "draft", "model": args.draft, "num_speculative_tokens": args.k} if mode == "draft" else None)
    cfg = cluster.ContinuousBatchingConfig(page_size=16, per_request_processors=True, speculative=spec)
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        m.get_result(m.add_request(prompts[0], max_new_tokens=2, eos_token_id=-1), timeout=600)  # warm-up
        t0 = time.perf_counter()
        if together:
            rids = [m.add_request(p, max_new_tokens=args.new_tokens, eos_token_id=-1, **sampling(workload, i))
                    for i, p in enumerate(prompts)]
            outs = [m.get_result(r, timeout=600) for r in rids]
        else:
            outs = [m.get_result(m.add_request(p, max_new_tokens=args.new_tokens, eos_token_id=-1,
                                               **sampling(workload, i)), timeout=600) for i, p in enumerate(prompts)]
        wall = time.perf_counter() - t0
        stats = {k: v for k, v in m.stats().items() if k.startswith("spec_")}
    tokens = [o.generated_tokens for o in outs]
    if any(len(t) != args.new_tokens for t in tokens):
        raise SystemExit(f"{workload}/{mode}: a request wrote other than {args.new_tokens} tokens")
    return wall, tokens, stats


def transformers_rates(model_dir: str, prompts: list[list[int]], workload: str, args: argparse.Namespace) -> dict:
    """transformers' generate at batch 1: tokens/s plain and with prompt lookup (its n-gram proposer)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ways: list[tuple[str, dict]] = [("plain", {}), ("prompt lookup", {"prompt_lookup_num_tokens": args.k})]
    if args.draft:
        assistant = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
        assistant.generation_config.num_assistant_tokens = args.k
        ways.append(("assisted", {"assistant_model": assistant}))
    rates = {}
    for name, extra in ways:
        t0 = time.perf_counter()
        with torch.no_grad():
            for i, p in enumerate(prompts):
                torch.manual_seed(i)
                kw = {"do_sample": True, "temperature": 1.0} if workload == "random" else {"do_sample": False}
                hf.generate(torch.tensor([p]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                            eos_token_id=None, pad_token_id=0, **kw, **extra)
        rates[name] = len(prompts) * args.new_tokens / (time.perf_counter() - t0)
    return rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--draft", default=None, help="a draft checkpoint: the draft-model proposer too")
    p.add_argument("--no-transformers", action="store_true", help="skip transformers' reference")
    args = p.parse_args()
    if not Path(args.model, "config.json").exists():
        from launch.make_model import make_model

        make_model(Path(args.model), arch="llama", size="tiny", seed=0)
    import cluster

    model = cluster.load(args.model)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(args.prompt_tokens)]
               for _ in range(args.prompts)]
    print(f"{args.prompts} prompts of {args.prompt_tokens} tokens, {args.new_tokens} new tokens each, k={args.k}, "
          f"median of {args.runs} run(s)")
    modes = ("plain", "ngram", "draft") if args.draft else ("plain", "ngram")
    print(f"{'workload':<8} {'batch':>6} {'mode':>16} {'tok/s':>9} {'x plain':>8} {'accept len':>10}")
    for workload in WORKLOADS:
        for together in (False, True):
            rate, tokens = {}, {}
            for mode in modes:
                walls = []
                for _ in range(args.runs):
                    wall, tokens[mode], stats = run(model, workload, mode, prompts, args, together)
                    walls.append(wall)
                rate[mode] = args.prompts * args.new_tokens / statistics.median(walls)
                if tokens[mode] != tokens["plain"]:
                    raise SystemExit(f"{workload}/{mode}: speculative tokens differ from plain decoding's")
                batch = args.prompts if together else 1
                print(f"{workload:<8} {batch:>6} {mode:>16} {rate[mode]:>9.1f} {rate[mode] / rate['plain']:>8.2f} "
                      f"{stats.get('spec_mean_accept_length', 0.0):>10.2f}", flush=True)
        if not args.no_transformers:
            hf = transformers_rates(args.model, prompts, workload, args)
            for name, r in hf.items():
                print(f"{workload:<8} {1:>6} {'hf ' + name:>16} {r:>9.1f} {r / hf['plain']:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
