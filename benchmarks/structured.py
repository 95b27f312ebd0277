"""The throughput cost of structured outputs: one batch of constrained requests against the same batch without the
constraint, on one manager (TP=1, in this process).

    python benchmarks/structured.py --model models/small [--requests 32] [--new-tokens 64] [--runs 3]

Every request samples (temperature 1, its own seed) with EOS off, so each one writes exactly --new-tokens tokens
in every mode (checked): `plain` has no constraint; `history` adds a presence penalty of 1e-6, which makes its rows
need their history (no burst, no tokens in flight) as a constraint does, with no mask; `constrained` holds every
request to a JSON schema (an array of exactly --new-tokens integers, so the grammar never ends first). The modes
run in turn, --runs times; the median wall time of each is printed with its tokens/s and the ratio to `plain`.
`mask ms/token` is the host time of the constrained rows' masks (llguidance's bitmask fill, the consumption of
the new tokens, and queueing the expansion on the device) per constrained token. A missing checkpoint is made
first (llama, tiny, seed 0)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("plain", "history", "constrained")


class MaskClock:
    """Sums the host time spent in the constrained rows' masks (GrammarState.allowed and structured.mask_rows)."""

    def __init__(self) -> None:
        import driver.engine.logits_processing as lp
        import driver.engine.structured as st

        self.seconds = 0.0
        allowed, mask_rows = st.GrammarState.allowed, st.mask_rows

        def timed(fn):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0
            return wrapper

        st.GrammarState.allowed = timed(allowed)
        lp.mask_rows = timed(mask_rows)


def request_kwargs(mode: str, i: int, new_tokens: int) -> dict:
    kw = {"do_sample": True, "temperature": 1.0, "seed": i, "eos_token_id": -1}
    if mode == "history":
        kw["presence_penalty"] = 1e-6
    if mode == "constrained":
        kw["structured_output"] = {"json_schema": {"type": "array", "minItems": new_tokens, "maxItems": new_tokens,
                                                   "items": {"type": "integer", "minimum": 0, "maximum": 999}}}
    return kw


def run(model, mode: str, args: argparse.Namespace, clock: MaskClock) -> tuple[float, int, float]:
    """(wall seconds, tokens, mask seconds) of one batch in `mode`."""
    import cluster

    cfg = cluster.ContinuousBatchingConfig(per_request_processors=True, page_size=16,
                                           max_requests_per_batch=args.requests, max_batch_tokens=2048)
    prompts = [[1 + (7 * i + j) % 1000 for j in range(args.prompt_tokens)] for i in range(args.requests)]
    with model.continuous_batching_context_manager(continuous_batching_config=cfg) as m:
        # warm-up: the first structured request also imports llguidance and loads the tokenizer (about 1.5 s at 32k)
        m.get_result(m.add_request(prompts[0], max_new_tokens=2, **request_kwargs(mode, 0, 2)), timeout=600)
        before, t0 = clock.seconds, time.perf_counter()
        rids = [m.add_request(p, max_new_tokens=args.new_tokens, **request_kwargs(mode, i, args.new_tokens))
                for i, p in enumerate(prompts)]
        outs = [m.get_result(r, timeout=600) for r in rids]
        wall = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in outs)
    if tokens != args.requests * args.new_tokens:
        raise SystemExit(f"{mode}: {tokens} tokens, expected {args.requests * args.new_tokens}")
    return wall, tokens, clock.seconds - before


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    if not Path(args.model, "config.json").exists():
        from launch.make_model import make_model

        make_model(Path(args.model), arch="llama", size="tiny", seed=0)
    import cluster

    model = cluster.load(args.model)
    clock = MaskClock()
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    mask_s: list[float] = []
    print(f"{'mode':<12} {'run':>3} {'wall s':>8} {'tokens':>7} {'tok/s':>8}")
    for r in range(args.runs):
        for mode in MODES:
            wall, tokens, masked = run(model, mode, args, clock)
            walls[mode].append(wall)
            if mode == "constrained":
                mask_s.append(masked / tokens)
            print(f"{mode:<12} {r + 1:>3} {wall:>8.2f} {tokens:>7} {tokens / wall:>8.1f}", flush=True)
    tokens = args.requests * args.new_tokens
    plain = statistics.median(walls["plain"])
    print(f"median over {args.runs} runs ({args.requests} requests x {args.new_tokens} tokens, vocab "
          f"{model.config.vocab_size}):")
    for mode in MODES:
        wall = statistics.median(walls[mode])
        print(f"  {mode:<12} {tokens / wall:8.1f} tok/s   {plain / wall:5.2f} x plain")
    print(f"  mask ms/token (host): {1e3 * statistics.median(mask_s):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
