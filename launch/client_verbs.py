"""CLI verbs that talk to a running cluster: `submit`, `stats`, `health`, `update-weights`. A refused call prints
`{"error": code, "message": ...}` on stderr and exits 2; a refused weight update also prints the cluster's result
on stdout, adds its `rank` and `reason` and exits 1."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from cluster.protocol import DEFAULT_ADDRESS


def _call(args: argparse.Namespace, verb: Callable[[Any], None]) -> int:
    """Run `verb(client)` on a client of args.address; a refusal is printed on stderr (exit 1 or 2, above)."""
    from cluster.client import Client
    from cluster.errors import ClientError, WeightUpdateError

    with Client(args.address, timeout=args.timeout, server_timeout_s=args.server_timeout) as c:
        try:
            verb(c)
        except ClientError as e:
            extra = {"rank": e.rank, "reason": e.reason} if isinstance(e, WeightUpdateError) else {}
            if extra:  # the cluster's result still goes to stdout, as for an accepted one
                print(json.dumps(e.result, indent=2))
            print(json.dumps({"error": e.code, "message": e.message, **extra}), file=sys.stderr)
            return 1 if extra else 2
    return 0


def submit(args: argparse.Namespace) -> int:
    params = {"max_new_tokens": args.max_new_tokens, "text": args.text}
    if args.temperature is not None:
        params.update(do_sample=True, temperature=args.temperature)
    input_ids = [int(t) for t in args.input_ids.split(",")] if args.text is None else None

    def verb(c: Any) -> None:
        if not args.stream:
            print(json.dumps(c.generate(input_ids, **params).to_dict()))
            return
        for out in c.stream(input_ids, **params):
            print(json.dumps({"request_id": out.request_id, "generated_tokens": out.generated_tokens,
                              "status": out.status.name}), flush=True)

    return _call(args, verb)


def stats(args: argparse.Namespace) -> int:
    return _call(args, lambda c: print(json.dumps(c.stats() if args.verb == "stats" else c.health(), indent=2)))


def update_weights(args: argparse.Namespace) -> int:
    return _call(args, lambda c: print(json.dumps(c.update_weights(args.path, kv_policy=args.kv_policy,
                                                                   partial=args.partial), indent=2)))


def add_parsers(sub: argparse._SubParsersAction) -> None:
    def verb(name: str, text: str, func: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=text)
        p.add_argument("--address", default=DEFAULT_ADDRESS)
        p.add_argument("--timeout", type=float, default=600.0)
        p.add_argument("--server-timeout", type=float, default=5.0,
                       help="seconds a silent server is waited for before the call fails with server_gone")
        p.set_defaults(func=func)
        return p

    p = verb("submit", "send one request to a running cluster and print its output", submit)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input-ids", help="comma-separated token ids")
    src.add_argument("--text", help="text (the checkpoint needs a tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float)
    p.add_argument("--stream", action="store_true", help="print one line per generated token")
    for name, text in (("stats", "the driver's counters"), ("health", "whether the cluster serves")):
        verb(name, f"print {text} as JSON", stats)
    p = verb("update-weights", "load new weights into a running cluster", update_weights)
    p.add_argument("path", help="a checkpoint directory every rank can read")
    p.add_argument("--kv-policy", choices=("keep", "recompute"), default="keep")
    p.add_argument("--partial", action="store_true", help="the checkpoint holds a subset of the model's tensors")
