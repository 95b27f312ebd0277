"""`lockstep`: the command line. Each verb lives in its own module; this file only dispatches."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from launch import make_model
from launch.torchrun import torchrun_command

DEFAULT_MODEL = Path("models/tiny-llama")


def run_main_job(args: argparse.Namespace) -> int:
    """The embedded default: make the tiny model if missing, then a TP=N generation through torchrun."""
    model = Path(args.model)
    if not (model / "config.json").exists():
        make_model.make_model(model, arch="llama", size="tiny", seed=0)
        print(f"made tiny llama checkpoint at {model}")
    extra = ["--model", str(model), "--num-prompts", str(args.num_prompts), "--new-tokens", str(args.new_tokens)]
    if args.config:
        extra += ["--config", args.config]
    if args.tp == 1:
        cmd = [sys.executable, "-m", "launch.demo", *extra]
    else:
        cmd = torchrun_command(args.tp, "launch.demo", extra)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.call(cmd, env=env if args.tp > 1 else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lockstep", description="tensor-parallel LLM serving")
    sub = p.add_subparsers(dest="verb", required=True)

    mm = sub.add_parser("make-model", help="write a randomly initialised checkpoint")
    make_model.add_arguments(mm)
    mm.set_defaults(func=make_model.run)

    run = sub.add_parser("run", help="the main job: a TP generation on the embedded tiny model")
    run.add_argument("--model", default=str(DEFAULT_MODEL))
    run.add_argument("--tp", type=int, default=2)
    run.add_argument("--num-prompts", type=int, default=32)
    run.add_argument("--new-tokens", type=int, default=32)
    run.add_argument("--config", help="a TOML preset from configs/")
    run.set_defaults(func=run_main_job)

    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
