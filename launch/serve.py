"""`lockstep serve`, one rank of it: every rank loads its shard and runs its loop; rank 0 also opens the
ZeroMQ front door and prints `ready <address>` once it serves. Started through torchrun (`-m launch.serve`) or
by launch/ray_launcher.py's actors (`serve_rank`, minus signals and exit). Exit codes: 0 after a clean stop,
3 when a rank failed (the launcher may then restart the group)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Callable

RANK_FAILED_EXIT = 3


def frontend_config(preset: dict, address: str | None):
    from cluster.http_config import HTTP_SERVE_KEYS, http_admin_trust, sglang_enable_memory_saver
    from driver.frontdoor.frontend import FrontendConfig

    http_admin_trust(preset.get("serve"))  # a bad entry stops the start here, before any rank loads
    sglang_enable_memory_saver(preset.get("serve"))
    table = {k: v for k, v in preset.get("serve", {}).items() if k not in HTTP_SERVE_KEYS}
    if unknown := set(table) - set(FrontendConfig.__dataclass_fields__):
        raise ValueError(f"[serve] table: unknown key(s) {sorted(unknown)} "
                         f"(known: {sorted(FrontendConfig.__dataclass_fields__)})")
    return FrontendConfig(**table | ({"address": address} if address else {}))


def weights_record_path(run_dir: str | None) -> str:
    """The record of the weights served (driver/frontdoor/served_weights.py) in `run_dir` (made, or a new temporary
    directory), emptied: a fresh `lockstep serve` starts from its --model, a restarted group from the record."""
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
    else:
        run_dir = tempfile.mkdtemp(prefix="lockstep-run-")
    path = os.path.join(os.path.abspath(run_dir), "weights.json")
    if os.path.exists(path):
        os.unlink(path)
    return path


def serve_rank(model_dir: str, preset: dict | str | os.PathLike | None = None, address: str | None = None,
               stop_event: threading.Event | None = None, *, on_started: Callable[[], None] | None = None,
               on_ready: Callable[[str], None] | None = None, state_file: str | None = None,
               http: str | None = None, interrupted: threading.Event | None = None) -> int:
    """Serve as this rank until `stop_event` is set or the step loop ends; returns the exit code. Every rank of the
    group calls it (torchrun's environment set): it joins the process groups and runs the loop's collectives. It
    neither installs signal handlers nor exits (a Ray actor's thread can do neither). `on_started` runs on every
    rank once the loop runs (so a signal during loading still interrupts the load); `on_ready(address)` on rank 0.
    `state_file`: the weights record (driver/frontdoor/served_weights.py); `http`: HOST:PORT of the OpenAI gateway
    rank 0 runs as a child process (launch/gateway/child.py); `interrupted`: set with `stop_event` when the stop is a
    user's interrupt (SIGINT), so rank 0 stops at once instead of first giving a dead rank's report time to arrive."""
    import cluster
    from cluster.config import ContinuousBatchingConfig, expert_parallel, model_impl, read_preset
    from driver.frontdoor.served_weights import WeightsRecord, restore

    preset = read_preset(preset)
    stop = stop_event if stop_event is not None else threading.Event()
    # a serving API honours per-request sampling unless the preset says otherwise (docs/protocol.md)
    cb = ContinuousBatchingConfig.from_any({"per_request_processors": True}
                                           | dict(preset.get("continuous_batching", {})))
    fe_cfg = frontend_config(preset, address)
    join_attempt_group(cb.cpu_group_timeout)
    model = cluster.load(model_dir, cpu_group_timeout=cb.cpu_group_timeout,
                         expert_parallel=expert_parallel(preset.get("model")),
                         model_impl=model_impl(preset.get("model")))
    manager = model.init_continuous_batching(continuous_batching_config=cb)
    record = WeightsRecord(state_file)
    restore(manager, record)  # every rank: the weights the group served before a restart, under their version
    manager.warmup()
    manager.start()
    manager.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if on_started is not None:
        on_started()

    frontend = gateway = None
    if model.groups.is_driver:
        from driver.frontdoor.frontend import Frontend
        from driver.frontdoor.text_output import load_tokenizer

        frontend = Frontend(manager, fe_cfg, load_tokenizer(model_dir), record, model_path=model_dir).start()
        if http:
            from cluster.http_config import http_admin_token, http_admin_trust, sglang_enable_memory_saver
            from launch.gateway.child import GatewayProcess

            serve = preset.get("serve")
            gateway = GatewayProcess(dialable(frontend.address), http, model_dir, http_admin_token(serve),
                                     http_admin_trust(serve), sglang_enable_memory_saver(serve)).start()
        print(f"ready {frontend.address}", flush=True)
        if on_ready is not None:
            on_ready(frontend.address)
    while not stop.wait(0.2) and manager.is_running():
        pass
    if model.groups.is_driver and manager.is_running():
        # stopped by a signal; when the launcher sends it because a rank died (torchrun: SIGTERM to the survivors),
        # let the loop notice and name it; a user's interrupt has nothing to wait for
        deadline = time.monotonic() + (0.0 if interrupted is not None and interrupted.is_set() else 3.0)
        while manager.is_running() and time.monotonic() < deadline:
            time.sleep(0.05)
        if manager.is_running():
            manager.stop(hard_stop=True, timeout=10)
    elif not model.groups.is_driver:
        manager.join(timeout=5)
    if gateway is not None:
        gateway.stop()
    if frontend is not None:
        frontend.stop()
    if manager.failure:
        print(f"lockstep: {manager.failure}", file=sys.stderr, flush=True)
    return RANK_FAILED_EXIT if manager.loop_error is not None else 0


def dialable(address: str, host: str = "127.0.0.1") -> str:
    """Where a client dials a front door bound at `address`: a wildcard host becomes `host` (IPv6's: loopback)."""
    for wildcard, local in (("tcp://0.0.0.0:", f"tcp://{host}:"), ("tcp://*:", f"tcp://{host}:"),
                            ("tcp://[::]:", "tcp://[::1]:")):
        if address.startswith(wildcard):
            return local + address[len(wildcard):]
    return address


def join_attempt_group(cpu_group_timeout: float | None) -> None:
    """Join the default process group under a key prefix of this restart attempt. Every rank calls it.

    torchrun's static rendezvous keeps one store across restarts: a restarted group using the plain keys could
    read the dead group's addresses. Keys under `attempt_<TORCHELASTIC_RESTART_COUNT>` are this group's own."""
    import torch.distributed as dist

    from cluster.dist import group_timeouts, pick_device, settle_timeout

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        return
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    # a restarted peer may take longer to start than the failure timeout (a loaded host): join under the longer one
    timeout, join = group_timeouts(cpu_group_timeout)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=join))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dev = pick_device(local_rank)
    if dev.type == "cuda":
        import torch

        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world, timeout=join,
                            store=dist.PrefixStore(f"attempt_{attempt}", store),
                            device_id=dev if dev.type == "cuda" else None)
    settle_timeout((dist.group.WORLD,), timeout, join)


def main(argv: list[str] | None = None) -> int:
    """The torchrun entry: one rank of `lockstep serve`, stopped by SIGINT/SIGTERM."""
    p = argparse.ArgumentParser(prog="launch.serve")
    p.add_argument("--model", required=True)
    p.add_argument("--config", help="a TOML preset ([continuous_batching] and [serve] tables)")
    p.add_argument("--address", help="ZeroMQ bind address (default tcp://127.0.0.1:5555)")
    p.add_argument("--state-file", help="the record of the weights served, read again after a restart")
    p.add_argument("--http", help="HOST:PORT: also serve the OpenAI-compatible HTTP gateway (rank 0)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s rank" + os.environ.get("RANK", "0")
                        + " %(levelname)s %(message)s")

    stop, interrupted = threading.Event(), threading.Event()

    def on_signal(sig: int, _frame) -> None:
        if sig == signal.SIGINT:
            interrupted.set()
        stop.set()

    def install_signal_handlers() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    code = serve_rank(args.model, args.config, args.address, stop, on_started=install_signal_handlers,
                      state_file=args.state_file, http=args.http, interrupted=interrupted)
    os._exit(code)  # daemon threads may sit in a broken collective: leave without joining them


if __name__ == "__main__":
    raise SystemExit(main())
