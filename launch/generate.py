"""`lockstep generate`, one rank of it: an offline batch from a JSONL file through generate_batch.

Each input line is {"input_ids": [...]} or {"text": "..."} (optionally "max_new_tokens"); each output line
is {"index", "request_id", "generated_tokens", "status", "error"}, in input order. Rank 0 writes the file."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch.generate")
    p.add_argument("--model", required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--config", help="a TOML preset from configs/")
    args = p.parse_args(argv)

    from launch.load import load_with_preset

    model, cb = load_with_preset(args.model, args.config)
    rows = [json.loads(line) for line in open(args.input) if line.strip()]
    prompts = []
    for i, row in enumerate(rows):
        if "input_ids" in row:
            prompts.append(row["input_ids"])
        elif "text" in row:
            from transformers import AutoTokenizer

            prompts.append(AutoTokenizer.from_pretrained(args.model)(row["text"])["input_ids"])
        else:
            print(f"line {i + 1}: needs input_ids or text", file=sys.stderr)
            return 2
    out = model.generate_batch(prompts, continuous_batching_config=cb,
                               max_new_tokens=args.max_new_tokens, progress_bar=True)
    if model.groups.is_driver:
        with open(args.output, "w") as f:
            for i, o in enumerate(out.values()):
                f.write(json.dumps({"index": i, "request_id": o.request_id, "generated_tokens": o.generated_tokens,
                                    "status": o.status.name, "error": o.error}) + "\n")
        print(f"wrote {len(out)} outputs to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
