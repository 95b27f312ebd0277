"""The control plane against a simulated fast device: does the host's step work hide behind the forward?

    python benchmarks/control_plane.py            # TP=2 and TP=4; 8, 64, 256, 512 sequences; 2 and 5 ms steps
    python benchmarks/control_plane.py --quick    # 256 sequences at TP=2 only (under three minutes)

The script spawns the ranks itself (gloo; no GPU needed). Everything is the real code except the forward: the
driver runs the real Engine (scheduler, plans, sampler, request updates), the real send_plan / recv_plan
carry every plan, the workers run the real worker loop, and every rank lays each plan out in the runner's
static buffers with the real ModelRunner.prepare, in the flash-attn layout a GPU would use. The forward is
a fixed device time (`--step-ms`) on a virtual device clock (benchmarks/simulated_device.py): one thread a rank
(a worker.stream.ThreadStream) issues the queued device work in order and runs it for real, with the LM head on
small fake logits (vocab 256) and the real sampler's launch. As on a CUDA stream that thread does not wait for a
step's end before issuing the next step's work, and the host sees a step's tokens once the device clock has
passed its end (`--sync-device`: the thread waits for each step's end). The head's collective (for the greedy
rows, the argmax on the shards) is part of the step time, as on a GPU (`--head device`), or runs for real over
gloo on the device thread (`--head gloo`).

Each configuration starts with its sequences already at 2k context (their KV pages allocated, their
prompts counted as computed: no prefill forward), runs --warmup steps, then measures --steps decode steps:
  busy      the simulated forwards' time (steps x step ms) / wall time (rank 0): the fraction of the wall
            the device spends on forwards
  dev thr   the device thread's occupancy (its work and, with --sync-device, its waits) / wall;
            step ms: wall time per step
  host ms   rank 0's host time per step in the loop thread, split into schedule (Scheduler.schedule),
            plan (Engine._plan), bcast (send_plan, less bwait: its wait for the last worker to enter
            recv_plan, from both processes' clocks, shown beside and not counted), prepare (ModelRunner.prepare), sample (building the
            sample rows; serial: the whole sampling) and collect (the tokens into the requests, endings);
            waits for the device are not host time.
  device    rank 0's device thread per step: waits for the step's end (--sync-device), gather (the head's
            collective), sample (the sampler's launch), the rest, its lead over the device clock (ahead), its
            lateness (overrun: a step's last op issued after the step's end) and the device's idle time (late)
and prints, per configuration, `busy=<percent> step_ms=<ms> seqs=<n> tp=<n> overlap=<on|off>` (step_ms: the
simulated forward time), then the burst length, the head's collective and the device model. Timings on a
shared 2-core machine are noisy. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from cluster.config import ContinuousBatchingConfig, ResolvedConfig, resolve_config  # noqa: E402
from cluster.dist import init_groups  # noqa: E402
from cluster.outputs import RequestStatus  # noqa: E402
from cluster.pause import PauseGate  # noqa: E402
from cluster.plan import Command  # noqa: E402
from driver.engine import engine as engine_module  # noqa: E402
from worker import loop as loop_module  # noqa: E402
from driver.engine.engine import Engine  # noqa: E402
from driver.engine.request import Request  # noqa: E402
from worker.loop import worker_loop  # noqa: E402
from worker.runner import ModelRunner  # noqa: E402

from benchmarks.simulated_device import (HEAD_COLLECTIVES, VOCAB, FakeHead, SimulatedForward,  # noqa: E402
                                         VirtualEvent, build_runner)
CONTEXT = 2048
PAGE = 256
ARRIVAL_NEW, ARRIVAL_PROMPT = 64, 32  # --arrival: mean new tokens of a request; a new request's prompt
PARTS = ("schedule", "plan", "bcast", "prepare", "sample", "collect")  # rank 0's host work; bcast: its transfer
SPLIT = ("bwait",)  # send_plan's wait for the last worker to enter recv_plan: not host work
DEVICE_PARTS = ("wait", "gather", "dsample")  # the device thread's; `share` (the rest of its time) is derived


def resolved(max_seqs: int, steps: int) -> ResolvedConfig:
    per_seq = -(-(CONTEXT + steps + 8) // PAGE)
    cfg = ContinuousBatchingConfig(page_size=PAGE, num_blocks=max_seqs * per_seq + 8, max_batch_tokens=2 * max_seqs,
                                   max_requests_per_batch=max_seqs, allow_block_sharing=True)
    rc = resolve_config(cfg, device_kind="cpu", max_model_len=2 * CONTEXT, kv_bytes_per_token=64, free_bytes=None,
                        flash_available=False)
    return dataclasses.replace(rc, attention="flash_attn")  # the GPU's layout: block tables, varlen metadata


class Clock:
    """Seconds spent in each part by the loop thread (`host`), or by every other thread (the device's)."""

    def __init__(self, parts: tuple[str, ...], host: bool) -> None:
        self.parts, self.host = parts, host
        self.spent = dict.fromkeys(parts, 0.0)
        self.main = threading.get_ident()

    def reset(self) -> None:
        self.spent = dict.fromkeys(self.parts, 0.0)

    def wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if (threading.get_ident() == self.main) != self.host:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - t0
        return timed


class PlanStamps:
    """perf_counter stamps of every send_plan (entry, exit) on rank 0 or recv_plan (entry) on a worker, in call
    order: the n-th call on each rank is the same plan, so a worker's entry tells how long rank 0's broadcast
    waited for it (CLOCK_MONOTONIC is one clock for every process of a host)."""

    def __init__(self) -> None:
        self.enter: list[float] = []
        self.exit: list[float] = []

    def wrap(self, fn: Callable) -> Callable:
        def stamped(*args: Any, **kwargs: Any) -> Any:
            self.enter.append(time.perf_counter())
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit.append(time.perf_counter())
        return stamped


def split_bcast(row: dict, sent: PlanStamps, ready: list[list[float]], forwards: int) -> None:
    """Split the measured window's send_plan time (calls row['calls']) into the wait for the last worker to enter
    recv_plan (bwait) and the rest (bcast: the transfer), per forward."""
    a, b = row.pop("calls")
    wait = total = 0.0
    for i in range(a, b):
        t0, t1 = sent.enter[i], sent.exit[i]
        arrived = max(w[i] for w in ready) if ready else t0
        wait += min(max(0.0, arrived - t0), t1 - t0)
        total += t1 - t0
    row["bwait"], row["bcast"] = 1000 * wait / forwards, 1000 * (total - wait) / forwards


def instrument(engine: Engine, runner: ModelRunner, clock: Clock, device: Clock, forward: "SimulatedForward",
               send_plan: Callable) -> None:
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    engine._plan = clock.wrap("plan", engine._plan)
    engine_module.send_plan = send_plan  # already stamped (PlanStamps); split afterwards (split_bcast)
    runner.prepare = clock.wrap("prepare", ModelRunner.prepare.__get__(runner))
    engine.sampler.rows = clock.wrap("sample", engine.sampler.rows)
    engine.sampler.launch = clock.wrap("sample", engine.sampler.launch)  # serial only: overlapped, it runs
    engine._collect = clock.wrap("collect", engine._collect)  # the tokens into the requests (or their failures)
    engine.sampler.collect_burst = clock.wrap("collect", engine.sampler.collect_burst)
    engine._apply_burst = clock.wrap("collect", engine._apply_burst)
    engine.sampler.launch = device.wrap("dsample", engine.sampler.launch)
    forward.sleep = device.wrap("wait", SimulatedForward.sleep.__get__(forward))
    head = runner.model.lm_head
    head.collective = device.wrap("gather", FakeHead.collective.__get__(head))  # either of the head's collectives


def prefilled(engine: Engine, seqs: int, new_tokens: int, arrival: bool) -> None:
    """`seqs` requests at CONTEXT tokens, their pages allocated and every prompt token but the last computed.
    `arrival`: each asks for 1 to 2 x ARRIVAL_NEW tokens, so that requests leave every step."""
    rng = np.random.default_rng(0)
    for i in range(seqs):
        new = int(rng.integers(1, 2 * ARRIVAL_NEW)) if arrival else new_tokens
        req = Request(f"r{i}", rng.integers(0, VOCAB, CONTEXT).tolist(), max_new_tokens=new)
        req.num_computed = CONTEXT - 1
        assert engine.blocks.allocate(req, CONTEXT)
        req.status = RequestStatus.DECODING
        engine.scheduler.running.append(req)


def top_up(engine: Engine, seqs: int, rng: np.random.Generator) -> int:
    """The arrival-rate run: as many new requests (ARRIVAL_PROMPT tokens, 16 to 2 x ARRIVAL_NEW new) as have left
    since the last step, so that `seqs` are held; returns how many joined."""
    s = engine.scheduler
    joined = seqs - len(s.running) - len(s.waiting)
    for _ in range(joined):
        engine.scheduler.add(Request(f"a{engine.step_no}-{_}", rng.integers(0, VOCAB, ARRIVAL_PROMPT).tolist(),
                                     max_new_tokens=int(rng.integers(16, 2 * ARRIVAL_NEW))))
    return max(0, joined)


def drive(engine: Engine, runner: ModelRunner, forward: SimulatedForward, seqs: int, step_ms: float,
          warmup: int, steps: int, sent: PlanStamps, arrival: bool) -> dict:
    """One configuration on the driver; the workers follow its plans. `steps` counts forwards (a burst plan
    runs several); every figure is per forward. `arrival`: requests leave and join every step (`top_up`)."""
    # the workers' simulated step time, and which op closes a step's window
    engine.send(Command.PUBLISH, msgpack.packb({"step_ms": step_ms, "overlap": engine.rc.overlap}))
    forward.step_s, forward.overlapped = step_ms / 1000, engine.rc.overlap
    prefilled(engine, seqs, warmup + steps + 2 * engine.rc.decode_burst + 4, arrival)  # a burst may overshoot
    rng, joined = np.random.default_rng(1), 0
    clock, device = Clock(PARTS, host=True), Clock(DEVICE_PARTS, host=False)
    send_plan = engine_module.send_plan
    instrument(engine, runner, clock, device, forward, send_plan)
    try:
        start = forward.calls
        while forward.calls - start < warmup:
            engine.step()
            if arrival:
                top_up(engine, seqs, rng)
        clock.reset()
        device.reset()
        waited = VirtualEvent.waited_s
        busy0, calls0, plans0, sends0 = runner.stream.busy_s, forward.calls, engine.step_no, len(sent.enter)
        t0 = max(time.perf_counter(), forward.closed)  # from the end of the warm-up's forwards on the device clock
        forward.reset_counts()
        while forward.calls - calls0 < steps:
            engine.step()
            if arrival:
                joined += top_up(engine, seqs, rng)
        engine.flush()
        runner.stream.submit(lambda: None).value()  # the last step is issued
        clock.spent["collect"] -= VirtualEvent.waited_s - waited  # the host's waits for the device are not its work
        VirtualEvent(forward.closed).synchronize()  # and done
        wall, busy = time.perf_counter() - t0, runner.stream.busy_s - busy0
        steps, plans, sends = forward.calls - calls0, engine.step_no - plans0, (sends0, len(sent.enter))
    finally:
        engine_module.send_plan = send_plan
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.end(req, RequestStatus.CANCELLED)
    return {"seqs": seqs, "step_ms": step_ms, "burst": steps / max(1, plans), "calls": sends,
            "overrun": 1000 * forward.overrun_s / steps, "late": 1000 * forward.late_s / steps,
            "ahead": 1000 * forward.ahead_s / steps,
            "busy": 100 * steps * step_ms / 1000 / wall,
            "thread": 100 * busy / wall, "wall_ms": 1000 * wall / steps, "forwards": steps, "joins": joined / steps,
            **{k: 1000 * v / steps for k, v in (clock.spent | device.spent).items()},
            "share": 1000 * (busy - sum(device.spent.values())) / steps}


def rank_main(rank: int, tp: int, port: int, configs: list[tuple[int, float, bool, int, bool]], warmup: int, steps: int,
              head: str, queue: bool, out: Any) -> None:
    os.environ.update(WORLD_SIZE=str(tp), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    groups = init_groups(cpu_group_timeout=600, device="cpu")
    rc = resolved(max(c[0] for c in configs), warmup + steps + 2 * max(c[3] for c in configs))
    runner, forward = build_runner(rc, groups, head, queue)
    stamps = PlanStamps()
    try:
        if rank != 0:
            loop_module.recv_plan = stamps.wrap(loop_module.recv_plan)
            for plan in worker_loop(runner, groups, PauseGate(), lambda: None, lambda: False):
                sent = msgpack.unpackb(plan.data)
                forward.step_s, forward.overlapped = sent["step_ms"] / 1000, sent["overlap"]
            out.put(("ready", rank, stamps.enter))
            return
        engine_module.send_plan = stamps.wrap(engine_module.send_plan)
        results = []
        for seqs, step_ms, overlap, burst, arrival in configs:
            engine = Engine(runner, dataclasses.replace(rc, overlap=overlap, decode_burst=burst), groups, seed=0)
            row = drive(engine, runner, forward, seqs, step_ms, warmup, steps, stamps, arrival)
            results.append(row | {"tp": tp, "overlap": overlap, "max_burst": burst, "head": head,
                                  "device": "queue" if queue else "sync", "arrival": arrival})
            print(line(results[-1]), flush=True)
        engine.send(Command.STOP)
        out.put(("results", results, stamps))
    finally:
        runner.stream.close()
        groups.destroy()


def line(r: dict) -> str:
    """A configuration's summary line; host_ms once the broadcast's wait is split off (after every rank is done)."""
    host = f"host_ms={sum(r[p] for p in PARTS):.2f} " if "bwait" in r else ""
    return (f"busy={r['busy']:.1f} {host}step_ms={r['step_ms']:g} seqs={r['seqs']} tp={r['tp']} "
            f"overlap={'on' if r['overlap'] else 'off'} burst={r['max_burst']} head={r['head']} device={r['device']}"
            + (f" arrival={r['joins']:.2f}/fwd" if r["arrival"] else ""))


def mode(r: dict) -> str:
    """off, on, or on with bursts of up to k forwards a plan (`on/16`)."""
    return "off" if not r["overlap"] else "on" if r["max_burst"] == 1 else f"on/{r['max_burst']}"


def table(results: list[dict]) -> str:
    key = f"{'tp':>3} {'seqs':>5} {'fwd ms':>6} {'overlap':>7} "

    def start(r: dict) -> str:
        return f"{r['tp']:>3} {r['seqs']:>5} {r['step_ms']:>6g} {mode(r):>7} "

    head = key + f"{'busy %':>7} {'dev thr %':>9} {'step ms':>8} {'fwd/plan':>8} {'host ms':>8} " + \
        " ".join(f"{p:>8}" for p in PARTS + SPLIT)
    rows = ["overlap on/k: overlapped with multi-step decode, up to k forwards a plan; ms are per forward; "
            f"the head's collective: {results[0]['head']} (--head); the device: {results[0]['device']}", "",
            head, "-" * len(head)]
    for r in results:
        host = sum(r[p] for p in PARTS)
        rows.append(start(r) + f"{r['busy']:>7.1f} {r['thread']:>9.1f} {r['wall_ms']:>8.2f} {r['burst']:>8.2f} "
                    f"{host:>8.2f} " + " ".join(f"{r[p]:>8.2f}" for p in PARTS + SPLIT))
    rows += ["", "rank 0's device thread, ms a step: waits for the step's end (sync device only), its work (gather:",
             "the head's collective; other: advance, token broadcast), its lead over the device clock at a step's",
             "end (ahead), the step's last op issued after its end (overrun), the device idle before a step (late):"]
    cols = ("wait", "gather", "dsample", "share", "ahead", "overrun", "late")
    head = key + " ".join(f"{p:>8}" for p in ("wait", "gather", "sample", "other", "ahead", "overrun", "late"))
    rows += [head, "-" * len(head)]
    for r in results:
        rows.append(start(r) + " ".join(f"{r[p]:>8.2f}" for p in cols))
    return "\n".join(rows)


def collect(out, procs: list) -> tuple:
    """The next rank's message; SystemExit naming the rank as soon as one exits with an error (its traceback is on
    stderr) rather than waiting for a message that will not come."""
    import queue as queue_module

    while True:
        try:
            return out.get(timeout=0.5)
        except queue_module.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"rank {dead[0][0]} exited with status {dead[0][1]} (its traceback is above)")


def run_tp(tp: int, configs: list[tuple[int, float, bool, int, bool]], warmup: int, steps: int, head: str,
           queue: bool) -> list[dict]:
    from launch.torchrun import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, tp, port, configs, warmup, steps, head, queue, out), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    got = [collect(out, procs) for _ in range(tp)]
    for p in procs:
        p.join(timeout=60)
    _, results, sent = next(g for g in got if g[0] == "results")
    ready = [g[2] for g in got if g[0] == "ready"]
    for r in results:
        split_bcast(r, sent, ready, r["forwards"])
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 sequences at TP=2 only")
    ap.add_argument("--tp", type=int, nargs="+", default=None)
    ap.add_argument("--seqs", type=int, nargs="+", default=None)
    ap.add_argument("--step-ms", type=float, nargs="+", default=[2.0, 5.0])
    ap.add_argument("--burst", type=int, default=16,
                    help="also run overlapped with multi-step decode (decode_burst) of this many forwards; 1: not")
    ap.add_argument("--head", choices=HEAD_COLLECTIVES, default="device",
                    help="the LM head's collective: inside the step time, as on a GPU (device), or over gloo on the "
                    "simulated device thread (gloo); see benchmarks/simulated_device.py")
    ap.add_argument("--sync-device", action="store_true",
                    help="the device thread waits for each step's end before issuing the next step's ops (the "
                    "model before 2026-12-02); default: it runs ahead, as on a CUDA stream")
    ap.add_argument("--arrival", action="store_true",
                    help="requests leave and join every step (each asks for 1 to 2 x %d tokens; new ones bring %d-token "
                    "prompts), so bursts cannot run" % (64, 32))
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=None, help="measured steps per configuration")
    args = ap.parse_args()
    tps = args.tp or ([2] if args.quick else [2, 4])
    seqs = args.seqs or ([256] if args.quick else [8, 64, 256, 512])
    steps = args.steps or (600 if args.quick else 200)
    modes = [(False, 1), (True, 1)] + ([(True, args.burst)] if args.burst > 1 else [])
    configs = [(n, ms, ov, k, args.arrival) for n in seqs for ms in args.step_ms for ov, k in modes]
    results = []
    for tp in tps:
        results += run_tp(tp, configs, args.warmup, steps, args.head, not args.sync_device)
    print()
    print(table(results))
    print()
    for r in results:
        print(line(r))


if __name__ == "__main__":
    main()
