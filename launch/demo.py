"""The main job (`lockstep run`, or `torchrun --nproc-per-node 2 -m launch.demo --model DIR`): every rank loads its
shard and runs one generate_batch; rank 0 prints what came out, as text too when the checkpoint has a tokenizer."""

from __future__ import annotations

import argparse
import random
import time

PROMPTS = ("Return the number of", "Create a new", "The default value is", "Raise an exception if",
           "If the file does not exist", "Convert a string to", "This method is called when", "Read the data from")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch.demo")
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", help="a TOML preset from configs/")
    args = p.parse_args(argv)

    from driver.frontdoor.text_output import load_tokenizer
    from launch.load import load_with_preset

    model, cb = load_with_preset(args.model, args.config)
    tokenizer = load_tokenizer(args.model)
    rng = random.Random(args.seed)
    if tokenizer is not None:
        prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.num_prompts)]
    else:
        vocab = model.config.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 64))] for _ in range(args.num_prompts)]
    start = time.perf_counter()
    out = model.generate_batch(prompts, continuous_batching_config=cb, max_new_tokens=args.new_tokens,
                               progress_bar=True)
    elapsed = time.perf_counter() - start
    if model.groups.is_driver:
        tokens = sum(len(o.generated_tokens) for o in out.values())
        for rid, o in list(out.items())[:4]:
            print(f"{rid}: prompt {len(o.prompt_ids)} tokens -> {o.generated_tokens[:12]}...")
            if tokenizer is not None:  # random weights: the text is the tokenizer's, the sense is not there yet
                text = [tokenizer.decode(ids, skip_special_tokens=True) for ids in (o.prompt_ids, o.generated_tokens)]
                print(f"    {text[0]!r} -> {text[1]!r}")
        print(f"tp={model.groups.world_size} requests={len(out)} generated={tokens} tokens "
              f"in {elapsed:.2f}s: {tokens / elapsed:.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
