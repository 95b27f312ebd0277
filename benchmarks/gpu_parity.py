"""Correctness on one device, against transformers on the same device: what benchmarks/gpu_proof.sh checks.

    python benchmarks/gpu_parity.py --model DIR --device cuda --json OUT.json [--prompts 16 --new-tokens 32]
    python benchmarks/gpu_parity.py --model DIR --make-arch qwen3_moe --label MoE --no-bursts ...   # the MoE row

--make-arch ARCH writes a tiny checkpoint of ARCH (launch.make_model, seed 0) at --model first when none is there;
--label prefixes every check's name; --no-bursts leaves check 4 out (the MoE row: parity, graphs on = off);
--no-tokenizer makes that checkpoint without a tokenizer (the checks feed token ids: the CPU dry run's saving).

1. float32 greedy parity: Lockstep's generate_batch and transformers' generate (one prompt at a time, no
   padding) give identical tokens, EOS disabled so every request runs to --new-tokens.
2. bfloat16 closeness: Lockstep in bfloat16 (greedy, with logprobs, CUDA graphs off) against transformers in
   float32 fed the same tokens (teacher forcing): Lockstep's logprob error must stay within twice transformers'
   own bfloat16 error on the same tokens (plus 0.02), i.e. Lockstep loses no more precision than transformers.
3. CUDA graphs on against off (ContinuousBatchingConfig(use_cuda_graph=...)), both bfloat16 greedy with
   logprobs. bfloat16 tokens need not be identical: torch may pick another attention or matmul kernel for a
   graph's padded shape (cuDNN or flash SDPA, per shape), and a near-tie then flips. So the check is on
   logprobs: max |logprob on - logprob off| over every position where both runs had the same context (each
   prompt's tokens up to and including its first differing one; greedy's chosen logprob is its run's largest,
   so there too both values are their distributions' maxima) must be at most the tolerance
   max(GRAPHS_TOL_FLOOR = 0.05 nats, transformers' own bfloat16 error from check 2). A graph that replays stale
   inputs or the wrong KV changes what the model sees: on the small model one changed prompt token moves later
   positions' largest logprob by up to 0.3 nats. The JSON row states the tolerance, the difference and how many
   prompts were token-identical; the setting the runner resolved is beside.
4. Multi-step decode (decode_burst=8) against one step: the same logprob comparison and tolerance as 3.

Every check is one row of the JSON file (check, result, ok, and for 3 and 4 the figures); gpu_summary.py prints
them. Exit 1 if any fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

PAGE = 256
BF16_SLACK = 0.02  # nats: the absolute floor of the closeness bound
GRAPHS_TOL_FLOOR = 0.05  # nats: the least tolerance of graphs on against off (and bursts against one step)


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))] for _ in range(n)]


def free_device(device: str) -> None:
    """Hand a finished run's GPU memory back before the next run loads its model (on the CPU reference counting
    frees it: no collection, which costs a tiny dry run's step more than its model's forwards)."""
    if device.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()


def kv_blocks(device: str, prompts, new_tokens: int, burst: int) -> int | None:
    """The KV pages of a run: on a GPU None (the runner sizes its cache from the free memory, as a user's run
    does); on the CPU the pages these requests take, one spare each (the CPU default, 512 pages, is zeroed at
    every run: a tiny dry run's step paid more for that than for its forwards)."""
    if device.startswith("cuda"):
        return None
    return sum(-(-(len(p) + new_tokens + burst) // PAGE) + 1 for p in prompts)


def lockstep_run(model_dir: str, device: str, dtype: str, prompts, new_tokens: int, graphs: bool | None = None,
                 logprobs: bool = False, burst: int = 1) -> tuple[list[list[int]], list[list[float]], str]:
    """(tokens, logprobs, effective use_cuda_graph; with `burst`, the forwards bursts ran past their plans' first)
    of one generate_batch call on a freshly loaded model."""
    import cluster
    from transformers import GenerationConfig

    model = cluster.load(model_dir, dtype=dtype, device=device)
    resolved = []
    build = model.build_runner

    def recording_build(cb):  # the runner's resolved config says which graphs really run
        out = build(cb)
        resolved.append(out[1])
        return out

    model.build_runner = recording_build
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=new_tokens)
    cb = cluster.ContinuousBatchingConfig(page_size=PAGE, num_blocks=kv_blocks(device, prompts, new_tokens, burst),
                                          use_cuda_graph=graphs, return_logprobs=logprobs, decode_burst=burst,
                                          use_async_batching=True if burst > 1 else None)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                               max_new_tokens=new_tokens)
    tokens = [list(o.generated_tokens) for o in out.values()]
    lps = [list(o.logprobs or []) for o in out.values()]
    effective = f"{resolved[-1].use_cuda_graph}, attention {resolved[-1].attention}" if resolved else "?"
    if burst > 1:
        effective += f"; burst forwards {model.last_stats.get('burst_forwards', 0)}"
    del model, out
    free_device(device)
    return tokens, lps, effective


def hf_model(model_dir: str, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # run every request to max_new_tokens, as Lockstep does here
    return model


@torch.no_grad()
def hf_greedy(model, prompts, new_tokens: int, device: str) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
        outs.append(seq[0, len(p):].tolist())
    return outs


@torch.no_grad()
def teacher_logprobs(model, prompt: list[int], tokens: list[int], device: str) -> list[float]:
    """log p(tokens[i] | prompt + tokens[:i]) under `model`, in float32."""
    ids = torch.tensor([prompt + tokens], device=device)
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    lp = logits.log_softmax(-1)
    return lp.gather(-1, torch.tensor(tokens, device=device)[:, None])[:, 0].tolist()


def row(check: str, result: str, ok: bool | None, **figures) -> dict:
    mark = {True: "PASS", False: "FAIL", None: "info"}[ok]
    print(f"[{mark}] {check}: {result}", flush=True)
    return {"check": check, "result": result, "ok": ok, **figures}


@dataclasses.dataclass
class Eager:
    """The bfloat16 run without graphs that checks 3 and 4 compare against, and transformers' bf16 error."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    hf_bf16_error: float

    def tolerance(self) -> float:
        return max(GRAPHS_TOL_FLOOR, self.hf_bf16_error)


def same_context_gap(a_tokens, a_lps, b_tokens, b_lps) -> tuple[float, int]:
    """(max |logprob a - logprob b|, positions compared) over the positions where both greedy runs had the same
    context: each prompt's positions up to and including its first differing token."""
    gap, n = 0.0, 0
    for ta, la, tb, lb in zip(a_tokens, a_lps, b_tokens, b_lps):
        for i in range(min(len(la), len(lb))):
            gap, n = max(gap, abs(la[i] - lb[i])), n + 1
            if ta[i] != tb[i]:
                break
    return gap, n


def check_fp32(args, prompts) -> dict:
    ours, _, _ = lockstep_run(args.model, args.device, "float32", prompts, args.new_tokens)
    hf = hf_model(args.model, args.device, torch.float32)
    ref = hf_greedy(hf, prompts, args.new_tokens, args.device)
    del hf
    free_device(args.device)
    same = sum(a == b for a, b in zip(ours, ref))
    first = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    detail = "" if first is None else f"; first mismatch prompt {first}: {ours[first][:8]} vs {ref[first][:8]}"
    return row("float32 greedy parity vs transformers", f"{same}/{len(prompts)} prompts identical{detail}",
               same == len(prompts) and len(ours) == len(prompts))


def check_bf16(args, prompts) -> tuple[dict, Eager]:
    ours, ours_lp, _ = lockstep_run(args.model, args.device, "bfloat16", prompts, args.new_tokens, graphs=False,
                                    logprobs=True)
    ref32 = hf_model(args.model, args.device, torch.float32)
    exact = [teacher_logprobs(ref32, p, t, args.device) for p, t in zip(prompts, ours)]
    del ref32
    free_device(args.device)
    ref16 = hf_model(args.model, args.device, torch.bfloat16)
    theirs = [teacher_logprobs(ref16, p, t, args.device) for p, t in zip(prompts, ours)]
    del ref16
    free_device(args.device)
    err_ours = max((abs(a - b) for lp, ex in zip(ours_lp, exact) for a, b in zip(lp, ex)), default=float("inf"))
    err_hf = max(abs(a - b) for th, ex in zip(theirs, exact) for a, b in zip(th, ex))
    bound = 2 * err_hf + BF16_SLACK
    complete = all(len(lp) == args.new_tokens for lp in ours_lp)
    return row("bfloat16 closeness (max |logprob - fp32|)",
               f"lockstep {err_ours:.4f}, transformers bf16 {err_hf:.4f}, bound {bound:.4f}"
               + ("" if complete else "; logprobs missing"), complete and err_ours <= bound), \
        Eager(ours, ours_lp, err_hf)


def compare_to_eager(check: str, args, eager: Eager, tokens, lps, effective: str) -> dict:
    """Checks 3 and 4: `tokens`/`lps` against the eager run, within the stated logprob tolerance."""
    gap, positions = same_context_gap(tokens, lps, eager.tokens, eager.logprobs)
    tol = eager.tolerance()
    same = sum(a == b for a, b in zip(tokens, eager.tokens))
    complete = len(lps) == len(eager.tokens) and all(len(lp) == args.new_tokens for lp in lps)
    return row(check, f"max |logprob diff| {gap:.4f} over {positions} same-context positions, tolerance "
               f"{tol:.4f}; {same}/{len(eager.tokens)} prompts token-identical; use_cuda_graph {effective}"
               + ("" if complete else "; logprobs missing"), complete and gap <= tol,
               max_abs_logprob_diff=gap, tolerance=tol, positions=positions, identical_prompts=same)


def check_graphs(args, prompts, eager: Eager) -> dict:
    tokens, lps, effective = lockstep_run(args.model, args.device, "bfloat16", prompts, args.new_tokens,
                                          graphs=True, logprobs=True)
    return compare_to_eager("CUDA graphs on vs off (bfloat16 logprobs)", args, eager, tokens, lps,
                            f"True resolved to {effective}")


def check_bursts(args, prompts, eager: Eager) -> dict:
    """Multi-step decode (8 forwards a plan, overlapped, decode graphs replayed with the metadata advanced on the
    device) against one step."""
    tokens, lps, effective = lockstep_run(args.model, args.device, "bfloat16", prompts, args.new_tokens,
                                          graphs=True, logprobs=True, burst=8)
    return compare_to_eager("multi-step decode (decode_burst=8) vs one step (bfloat16 logprobs)", args, eager,
                            tokens, lps, effective)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", default=None)
    p.add_argument("--make-arch", default=None, help="write a tiny checkpoint of this arch at --model if missing")
    p.add_argument("--label", default="", help="prefix of every check's name, e.g. MoE")
    p.add_argument("--no-bursts", action="store_true", help="leave out check 4 (multi-step decode)")
    p.add_argument("--no-tokenizer", action="store_true", help="--make-arch writes no tokenizer")
    args = p.parse_args()
    if args.make_arch and not Path(args.model, "config.json").exists():
        from launch.make_model import make_model

        make_model(args.model, arch=args.make_arch, size="tiny", seed=0,
                   tokenizer=False if args.no_tokenizer else None)
    if args.device.startswith("cuda"):  # the same arithmetic for both engines: no TF32 in float32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.prompts, vocab)
    t0 = time.perf_counter()
    rows = [check_fp32(args, prompts)]
    bf16_row, eager = check_bf16(args, prompts)
    rows += [bf16_row, check_graphs(args, prompts, eager)]
    if not args.no_bursts:
        rows.append(check_bursts(args, prompts, eager))
    rows.append(row("parity checks time", f"{time.perf_counter() - t0:.1f} s on {args.device}", None))
    for r in rows:
        r["check"] = f"{args.label} {r['check']}".lstrip()
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
