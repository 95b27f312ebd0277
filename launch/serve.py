"""`lockstep serve`, one rank of it: every rank loads its shard and runs its loop; rank 0 also opens the
ZeroMQ front door and prints `ready <address>` once it serves.

Started by `lockstep serve` through torch's launcher (`python -m torch.distributed.run ... -m launch.serve`).
Exit codes: 0 after a clean stop (SIGINT/SIGTERM with every rank healthy), 3 when a rank failed (the
launcher may then restart the group; `stats` reports the restart count).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import tomllib

RANK_FAILED_EXIT = 3


def frontend_config(preset: dict, address: str | None):
    from driver.frontend import FrontendConfig

    table = dict(preset.get("serve", {}))
    curve = table.pop("curve", {})
    cfg = FrontendConfig(**table)
    if address:
        cfg.address = address
    if curve:
        from zmq.auth import load_certificate

        public, secret = load_certificate(curve["server_secret_file"])
        cfg.curve_public_key, cfg.curve_secret_key = public, secret
        cfg.curve_allowed_clients = [load_certificate(os.path.join(curve["allowed_clients_dir"], f))[0]
                                     for f in sorted(os.listdir(curve["allowed_clients_dir"])) if f.endswith(".key")]
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launch.serve")
    p.add_argument("--model", required=True)
    p.add_argument("--config", help="a TOML preset ([continuous_batching] and [serve] tables)")
    p.add_argument("--address", help="ZeroMQ bind address (default tcp://127.0.0.1:5555)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s rank" + os.environ.get("RANK", "0")
                        + " %(levelname)s %(message)s")

    import cluster
    from cluster.config import ContinuousBatchingConfig

    preset: dict = {}
    if args.config:
        with open(args.config, "rb") as f:
            preset = tomllib.load(f)
    cb = ContinuousBatchingConfig.from_any(preset.get("continuous_batching", {}))
    fe_cfg = frontend_config(preset, args.address)
    model = cluster.load(args.model, cpu_group_timeout=cb.cpu_group_timeout)
    manager = model.init_continuous_batching(continuous_batching_config=cb)
    manager.warmup()
    manager.start()
    manager.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    frontend = None
    if model.groups.is_driver:
        from driver.frontend import Frontend

        tokenizer = load_tokenizer(args.model)
        frontend = Frontend(manager, fe_cfg, tokenizer).start()
        print(f"ready {frontend.address}", flush=True)
    while not stop.wait(0.2) and manager.is_running():
        pass
    if model.groups.is_driver and manager.is_running():
        # stopped by a signal; when the launcher sends it because a rank died, let the loop notice and name it
        deadline = time.monotonic() + 3.0
        while manager.is_running() and time.monotonic() < deadline:
            time.sleep(0.05)
        if manager.is_running():
            manager.stop(hard_stop=True, timeout=10)
    elif not model.groups.is_driver:
        manager.join(timeout=5)
    if frontend is not None:
        frontend.stop()
    code = RANK_FAILED_EXIT if manager.loop_error is not None else 0
    if manager.failure:
        print(f"lockstep: {manager.failure}", file=sys.stderr, flush=True)
    os._exit(code)  # daemon threads may sit in a broken collective: leave without joining them


def load_tokenizer(model_dir: str):
    if not any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


if __name__ == "__main__":
    raise SystemExit(main())
