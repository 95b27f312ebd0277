"""The cost of a scoring request (prompt logprobs, the HTTP gateway's `echo` + `logprobs` with `max_tokens` 0 or 1)
against a generation of one token for the same prompts, on one manager (TP=1, in this process).

    python benchmarks/scoring.py --model models/tiny [--requests 32] [--min-len 64] [--max-len 256] [--runs 3]

Both modes submit the same prompts with `max_new_tokens=1` (greedy, EOS off) at once; `scoring` adds
`prompt_logprobs=0`. Prefix caching is off, so both compute every prompt token. The modes alternate run by run
(G, S, G, S ...). Printed: each pair's ratio; then per mode the median wall time of --runs runs, the steps and the
prompt tokens the engine computed (equal: a scoring request costs one prefill, no decode step), and the ratio of
the median wall times. `flops x` is the ratio of the arithmetic each mode needs: a scoring request must project
every prompt position onto the vocabulary (a log-softmax needs every logit), where a generation projects only its
last, so scoring's wall time at or under `flops x` means it adds nothing beyond that projection (with a vocabulary
small beside the layers, as in most served models, both tend to 1). A missing checkpoint is made first (llama,
tiny, seed 0)."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("generate_1", "scoring")


def run(model, prompts: list[list[int]], mode: str) -> tuple[float, int, int]:
    """(wall seconds, engine steps, prompt tokens computed) of one batch of requests in `mode`, on a fresh manager."""
    import cluster

    cfg = cluster.ContinuousBatchingConfig(page_size=16, allow_block_sharing=False)
    extra = {"prompt_logprobs": 0} if mode == "scoring" else {}
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        start = time.perf_counter()
        ids = [m.add_request(p, max_new_tokens=1, eos_token_id=-1, **extra) for p in prompts]
        outs = [m.get_result(i, timeout=600) for i in ids]
        wall = time.perf_counter() - start
        stats = m.stats()
    assert all(len(o.generated_tokens) == 1 for o in outs)
    assert all((o.prompt_logprobs is not None) == (mode == "scoring") for o in outs)
    return wall, stats["step"], stats["prompt_tokens_computed"]


def arithmetic(config, prompts: list[list[int]], logits_rows: int) -> float:
    """Multiply-adds x 2 of one batch: every prompt token through the layers (weights and causal attention scores),
    `logits_rows` positions through the vocabulary projection. Parameters counted on the meta device."""
    import torch
    import transformers

    with torch.device("meta"):
        lm = transformers.AutoModelForCausalLM.from_config(config)
    head = config.hidden_size * config.vocab_size
    layers = sum(p.numel() for n, p in lm.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    width = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    scores = sum(n * (n + 1) // 2 for n in map(len, prompts)) * 4 * width * config.num_hidden_layers
    return 2.0 * layers * sum(map(len, prompts)) + scores + 2.0 * head * logits_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    import cluster
    from launch.make_model import make_model

    if not (Path(args.model) / "config.json").exists():
        make_model(args.model)
    model = cluster.load(args.model)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.requests)]
    runs: dict[str, list] = {mode: [] for mode in MODES}
    for _ in range(args.runs):  # the modes alternate, so a machine that drifts shifts both alike
        for mode in MODES:
            runs[mode].append(run(model, prompts, mode))
    pairs = [s[0] / g[0] for g, s in zip(runs["generate_1"], runs["scoring"])]
    print("scoring / generate_1, each pair: " + ", ".join(f"{r:.2f}" for r in pairs))
    results = {mode: (statistics.median(r[0] for r in rs), rs[-1][1], rs[-1][2]) for mode, rs in runs.items()}
    base = results[MODES[0]][0]
    need = {"generate_1": arithmetic(model.config, prompts, len(prompts)),
            "scoring": arithmetic(model.config, prompts, sum(map(len, prompts)))}
    print(f"{'mode':<12} {'wall s':>8} {'steps':>6} {'prompt tokens':>14} {'x generate_1':>13} {'flops x':>8}")
    for mode, (wall, steps, tokens) in results.items():
        print(f"{mode:<12} {wall:>8.3f} {steps:>6} {tokens:>14} {wall / base:>13.2f} "
              f"{need[mode] / need['generate_1']:>8.2f}")


if __name__ == "__main__":
    main()
