"""`lockstep`: the command line. Each verb lives in its own module; this file only dispatches."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from launch import client_verbs, make_model
from launch.gateway import server as http_gateway
from launch.serve import weights_record_path
from launch.torchrun import torchrun_command

DEFAULT_MODEL = Path("models/tiny-llama")


def run_main_job(args: argparse.Namespace) -> int:
    """The embedded default: make the tiny model if missing, then a TP=N generation through torchrun."""
    model = Path(args.model)
    if not (model / "config.json").exists():
        make_model.make_model(model, arch="llama", size="tiny", seed=0)
        print(f"made tiny llama checkpoint at {model}")
    extra = ["--model", str(model), "--num-prompts", str(args.num_prompts), "--new-tokens", str(args.new_tokens),
             *flags(config=args.config)]
    if args.tp == 1:
        return subprocess.call([sys.executable, "-m", "launch.demo", *extra])
    return subprocess.call(torchrun_command(args.tp, "launch.demo", extra), env=ranks_env(args.tp))


def flags(**values: str | None) -> list[str]:
    """`--name value` for each value given (None or empty: left out)."""
    return [x for k, v in values.items() if v for x in (f"--{k.replace('_', '-')}", v)]


def ranks_env(tp: int) -> dict[str, str]:
    """The machine's cores shared among this node's ranks (torchrun's own default is 1 thread per rank)."""
    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tp))))


def run_ranks(args: argparse.Namespace, module: str, extra: list[str]) -> int:
    """Start `module` on args.tp local ranks through torch's launcher (multi-node when --nnodes > 1)."""
    cmd = torchrun_command(args.tp, module, extra)
    if getattr(args, "nnodes", 1) > 1:
        at = cmd.index("--master-addr")
        cmd[at:at + 4] = ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank),
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint]
    if getattr(args, "max_restarts", 0):
        cmd[3:3] = ["--max-restarts", str(args.max_restarts)]
    os.execve(cmd[0], cmd, ranks_env(args.tp))  # signals go straight to the launcher


def serve(args: argparse.Namespace) -> int:
    if args.replicas > 1 or args.spread:  # R groups behind one router (launch/router/replicas.py)
        if args.launcher != "ray":
            raise SystemExit("lockstep serve: --replicas and --spread need --launcher ray")
        from launch.router.replicas import run_cli as run_replicas

        return run_replicas(args)
    args.state_file = weights_record_path(args.run_dir)
    if args.launcher == "ray":  # the ranks become Ray actors; this process waits for SIGINT, then ends them
        from launch.ray_launcher import run_cli

        return run_cli(args)  # --http: the gateway runs in this process, in front of rank 0's address
    return run_ranks(args, "launch.serve", ["--model", args.model, "--state-file", args.state_file,
                                            *flags(config=args.config, address=args.address, http=args.http)])


def generate(args: argparse.Namespace) -> int:
    return run_ranks(args, "launch.generate", ["--model", args.model, "--input", args.input, "--output", args.output,
                                               "--max-new-tokens", str(args.max_new_tokens),
                                               *flags(config=args.config)])


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

    sv = sub.add_parser("serve", help="start the ranks and serve requests over ZeroMQ")
    sv.add_argument("--model", required=True)
    sv.add_argument("--tp", type=int, default=1)
    sv.add_argument("--config", help="a TOML preset ([continuous_batching] and [serve] tables)")
    sv.add_argument("--address", help="bind address (default tcp://127.0.0.1:5555)")
    sv.add_argument("--nnodes", type=int, default=1)
    sv.add_argument("--node-rank", type=int, default=0)
    sv.add_argument("--rdzv-endpoint", default="127.0.0.1:29400", help="host:port of the rendezvous (multi-node)")
    sv.add_argument("--max-restarts", type=int, default=3,
                    help="restarts of the whole group after a rank fails (default 3; 0: none). The group comes "
                         "back on the same address with the weights it last served, and clients resume their "
                         "requests token-exactly (docs/recovery.md)")
    sv.add_argument("--run-dir", help="where the group keeps its state across restarts (default: a new temporary dir)")
    sv.add_argument("--launcher", choices=["torchrun", "ray"], default="torchrun",
                    help="ray: start the ranks as Ray actors in a placement group (RAY_ADDRESS joins a running Ray)")
    sv.add_argument("--gpu", action="store_true", help="with --launcher ray: one GPU per rank")
    sv.add_argument("--http", help="HOST:PORT: also serve the OpenAI-compatible HTTP API from rank 0 (docs/http.md)")
    sv.add_argument("--replicas", type=int, default=1, help="with --launcher ray: this many groups of --tp ranks "
                    "behind one router at --address (docs/replicas.md)")
    sv.add_argument("--spread", action="store_true", help="with --replicas: every group on a different node")
    sv.add_argument("--service-name", default="lockstep", help="with --replicas: the named Ray actor (namespace "
                    "lockstep) whose client() Ray jobs take")
    sv.set_defaults(func=serve)

    hp = sub.add_parser("http", help="the OpenAI-compatible HTTP gateway of a running cluster, as its own process")
    http_gateway.add_arguments(hp)
    hp.set_defaults(func=http_gateway.run)

    gen = sub.add_parser("generate", help="offline batch: JSONL prompts in, JSONL outputs out")
    gen.add_argument("--model", required=True)
    gen.add_argument("--input", required=True)
    gen.add_argument("--output", required=True)
    gen.add_argument("--tp", type=int, default=1)
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--config")
    gen.set_defaults(func=generate)

    client_verbs.add_parsers(sub)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
