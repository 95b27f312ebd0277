"""The control plane against a simulated fast device: does the host's step work hide behind the forward?

    python benchmarks/control_plane.py            # TP=2 and TP=4; 8, 64, 256, 512 sequences; 2 and 5 ms steps
    python benchmarks/control_plane.py --quick    # 256 sequences at TP=2 only (under three minutes)

The script spawns the ranks itself (gloo; no GPU needed). Everything is the real code except the forward: the
driver runs the real Engine (scheduler, plans, sampler, request updates), the real send_plan / recv_plan
carry every plan, the workers run the real worker loop, and every rank lays each plan out in the runner's
static buffers with the real ModelRunner.prepare, in the flash-attn layout a GPU would use. The forward is
a fixed device time (`--step-ms`) on a worker.stream.ThreadStream (the simulated device: one thread running
the queued work in order), followed by a real gather of small fake logits (vocab 256) over the device group,
so the real sampler and, overlapped, the real token broadcast run on the device thread.

Each configuration starts with its sequences already at 2k context (their KV pages allocated, their
prompts counted as computed: no prefill forward), runs --warmup steps, then measures --steps decode steps:
  busy      the simulated forwards' time (steps x step ms) / wall time (rank 0): the fraction of the wall
            the device spends on forwards. Time the device thread spends in the fake-logits gather, sampling
            and the token broadcast is not counted: on this CPU those are gloo waits for the other rank and
            Python, which on a GPU take well under 0.1 ms a step
  dev thr   the device thread's occupancy (forward, gather, sampling, token broadcast, waits included) / wall
  step ms   wall time per step
  host ms   rank 0's host time per step in the loop thread, split into schedule (Scheduler.schedule),
            plan (Engine._plan), bcast (send_plan), prepare (ModelRunner.prepare), sample (building the
            sample rows; serial: the whole sampling) and collect (the tokens into the requests, endings);
            waits for the device are not host time.
  device    rank 0's device thread per step: forward, gather (the fake logits), sample (overlapped: the sampler's
            launch), share (the rest: the token broadcast and its waits for the other rank), and the busy bound
            forward / (forward + gather + sample) that this simulation allows with no host time at all
and prints, per configuration, `busy=<percent> step_ms=<ms> seqs=<n> tp=<n> overlap=<on|off>` (step_ms: the
simulated forward time). Timings on a shared 2-core machine are noisy. See docs/benchmarks.md.
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
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from cluster.config import ContinuousBatchingConfig, ResolvedConfig, resolve_config  # noqa: E402
from cluster.dist import init_groups  # noqa: E402
from cluster.outputs import RequestStatus  # noqa: E402
from cluster.pause import PauseGate  # noqa: E402
from cluster.plan import Command  # noqa: E402
from driver import engine as engine_module  # noqa: E402
from driver.engine import Engine  # noqa: E402
from driver.request import Request  # noqa: E402
from worker.layers import Shard  # noqa: E402
from worker.loop import worker_loop  # noqa: E402
from worker.runner import ModelRunner  # noqa: E402
from worker.stream import ThreadStream  # noqa: E402

VOCAB = 256
CONTEXT = 2048
PAGE = 256
PARTS = ("schedule", "plan", "bcast", "prepare", "sample", "collect")
DEVICE_PARTS = ("forward", "gather", "dsample")  # the device thread's; `share` (the rest of its time) is derived


class FakeHead:
    """Stands in for the model's ParallelLMHead: a real gather of fake logit shards on the device group."""

    def __init__(self, shard: Shard):
        self.shard = shard
        self.vocab_size = VOCAB

    def gather(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every rank of the device group calls it (the real head's collective)."""
        if self.shard.size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.shard.size)] if self.shard.rank == 0 else None
        dist.gather(local, parts, dst=0, group=self.shard.group)
        return None if parts is None else torch.cat(parts, dim=-1)


class FakeModel:
    """What ModelRunner reads of a model: the layer count and the head; the forward is `SimulatedForward`."""

    def __init__(self, shard: Shard):
        self.config = type("Config", (), {"num_hidden_layers": 1})()
        self.lm_head = FakeHead(shard)


class SimulatedForward:
    """A device step of `step_s`: the forward, returning fixed fake logits for meta's logit rows, and the device
    work around it that runs here for real on the device thread (the logits gather, sampling, the token broadcast,
    the burst's advance). The forward sleeps the step's time less the CPU time (time.thread_time) the device
    thread spent on that work since the last forward, so each step costs the device `step_s` unless that work
    alone takes longer; the thread's waits (for the other rank in a collective, for the GIL, for work to be queued)
    are not deducted: they stay lost time."""

    def __init__(self, tp: int, rank: int, rows: int):
        g = torch.Generator().manual_seed(rank)
        self.logits = torch.randn(rows, VOCAB // tp, generator=g)
        self.step_s = 0.005
        self.calls = 0
        self.cpu_mark: float | None = None  # the device thread's CPU clock when the last forward ended
        self.around_s = 0.0  # CPU seconds of device work around the forwards, summed

    def __call__(self, ids: torch.Tensor, meta: Any) -> torch.Tensor:
        self.calls += 1
        around = 0.0 if self.cpu_mark is None else time.thread_time() - self.cpu_mark
        self.around_s += around
        self.sleep(max(0.0, self.step_s - around))
        self.cpu_mark = time.thread_time()
        return self.logits[:meta.logits_idx.numel()]

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def resolved(max_seqs: int, steps: int) -> ResolvedConfig:
    per_seq = -(-(CONTEXT + steps + 8) // PAGE)
    cfg = ContinuousBatchingConfig(page_size=PAGE, num_blocks=max_seqs * per_seq + 8, max_batch_tokens=max_seqs,
                                   max_requests_per_batch=max_seqs, allow_block_sharing=True)
    rc = resolve_config(cfg, device_kind="cpu", max_model_len=2 * CONTEXT, kv_bytes_per_token=64, free_bytes=None,
                        flash_available=False)
    return dataclasses.replace(rc, use_flash_attn=True)  # the GPU's layout: block tables, varlen metadata


def build_runner(rc: ResolvedConfig, groups: Any) -> tuple[ModelRunner, SimulatedForward]:
    shard = Shard(groups.rank, groups.world_size, groups.device_group)
    runner = ModelRunner(FakeModel(shard), rc, kv_heads=1, head_dim=8, dtype=torch.float16,
                         device=torch.device("cpu"))
    runner.stream = ThreadStream(runner.device)
    forward = SimulatedForward(groups.world_size, groups.rank, rc.max_requests_per_batch)
    runner.forward_fn = forward
    return runner, forward


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


def instrument(engine: Engine, runner: ModelRunner, clock: Clock, device: Clock, forward: "SimulatedForward",
               send_plan: Callable) -> None:
    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    engine._plan = clock.wrap("plan", engine._plan)
    engine_module.send_plan = clock.wrap("bcast", send_plan)
    runner.prepare = clock.wrap("prepare", ModelRunner.prepare.__get__(runner))
    engine.sampler.rows = clock.wrap("sample", engine.sampler.rows)
    engine.sampler.launch = clock.wrap("sample", engine.sampler.launch)  # serial only: overlapped, it runs
    engine.sampler.collect = clock.wrap("collect", engine.sampler.collect)  # on the device thread
    engine._apply = clock.wrap("collect", engine._apply)
    engine.sampler.launch = device.wrap("dsample", engine.sampler.launch)
    forward.sleep = device.wrap("forward", SimulatedForward.sleep.__get__(forward))
    head = runner.model.lm_head
    head.gather = device.wrap("gather", FakeHead.gather.__get__(head))


def prefilled(engine: Engine, seqs: int, new_tokens: int) -> None:
    """`seqs` requests at CONTEXT tokens, their pages allocated and every prompt token but the last computed."""
    rng = np.random.default_rng(0)
    for i in range(seqs):
        req = Request(f"r{i}", rng.integers(0, VOCAB, CONTEXT).tolist(), max_new_tokens=new_tokens)
        req.num_computed = CONTEXT - 1
        assert engine.blocks.allocate(req, CONTEXT)
        req.status = RequestStatus.DECODING
        engine.scheduler.running.append(req)


def drive(engine: Engine, runner: ModelRunner, forward: SimulatedForward, seqs: int, step_ms: float,
          warmup: int, steps: int) -> dict:
    """One configuration on the driver; the workers follow its plans. `steps` counts forwards (a burst plan
    runs several); every figure is per forward."""
    engine.send(Command.PUBLISH, msgpack.packb({"step_ms": step_ms}))  # the workers' simulated forward time
    forward.step_s = step_ms / 1000
    prefilled(engine, seqs, warmup + steps + 4)
    clock, device = Clock(PARTS, host=True), Clock(DEVICE_PARTS, host=False)
    send_plan = engine_module.send_plan
    instrument(engine, runner, clock, device, forward, send_plan)
    try:
        while forward.calls < warmup:
            engine.step()
        clock.reset()
        device.reset()
        t0, busy0, calls0, plans0 = time.perf_counter(), runner.stream.busy_s, forward.calls, engine.step_no
        while forward.calls - calls0 < steps:
            engine.step()
        engine.flush()
        wall, busy = time.perf_counter() - t0, runner.stream.busy_s - busy0
        steps, plans = forward.calls - calls0, engine.step_no - plans0
    finally:
        engine_module.send_plan = send_plan
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.end(req, RequestStatus.CANCELLED)
    return {"seqs": seqs, "step_ms": step_ms, "burst": steps / max(1, plans), "busy": 100 * steps * step_ms / 1000 / wall,
            "thread": 100 * busy / wall, "wall_ms": 1000 * wall / steps,
            **{k: 1000 * v / steps for k, v in (clock.spent | device.spent).items()},
            "share": 1000 * (busy - sum(device.spent.values())) / steps}


def rank_main(rank: int, tp: int, port: int, configs: list[tuple[int, float, bool, int]], warmup: int, steps: int,
              out: Any) -> None:
    os.environ.update(WORLD_SIZE=str(tp), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    groups = init_groups(cpu_group_timeout=600, device="cpu")
    rc = resolved(max(c[0] for c in configs), warmup + steps + max(c[3] for c in configs))
    runner, forward = build_runner(rc, groups)
    try:
        if rank != 0:
            for plan in worker_loop(runner, groups, PauseGate(), lambda: None, lambda: False):
                forward.step_s = msgpack.unpackb(plan.data)["step_ms"] / 1000
            return
        results = []
        for seqs, step_ms, overlap, burst in configs:
            engine = Engine(runner, dataclasses.replace(rc, overlap=overlap, decode_burst=burst), groups, seed=0)
            row = drive(engine, runner, forward, seqs, step_ms, warmup, steps)
            results.append(row | {"tp": tp, "overlap": overlap, "max_burst": burst})
            print(line(results[-1]), flush=True)
        engine.send(Command.STOP)
        out.put(results)
    finally:
        runner.stream.close()
        groups.destroy()


def line(r: dict) -> str:
    return (f"busy={r['busy']:.1f} step_ms={r['step_ms']:g} seqs={r['seqs']} tp={r['tp']} "
            f"overlap={'on' if r['overlap'] else 'off'} burst={r['max_burst']}")


def mode(r: dict) -> str:
    """off, on, or on with bursts of up to k forwards a plan (`on/8`)."""
    return "off" if not r["overlap"] else "on" if r["max_burst"] == 1 else f"on/{r['max_burst']}"


def table(results: list[dict]) -> str:
    key = f"{'tp':>3} {'seqs':>5} {'fwd ms':>6} {'overlap':>7} "

    def start(r: dict) -> str:
        return f"{r['tp']:>3} {r['seqs']:>5} {r['step_ms']:>6g} {mode(r):>7} "

    head = key + f"{'busy %':>7} {'dev thr %':>9} {'step ms':>8} {'fwd/plan':>8} {'host ms':>8} " + \
        " ".join(f"{p:>8}" for p in PARTS)
    rows = ["overlap on/k: overlapped with multi-step decode, up to k forwards a plan; ms are per forward", "",
            head, "-" * len(head)]
    for r in results:
        host = sum(r[p] for p in PARTS)
        rows.append(start(r) + f"{r['busy']:>7.1f} {r['thread']:>9.1f} {r['wall_ms']:>8.2f} {r['burst']:>8.2f} "
                    f"{host:>8.2f} " + " ".join(f"{r[p]:>8.2f}" for p in PARTS))
    rows += ["", "rank 0's device thread, ms a forward (share: the token broadcast and waits; bound: forward / (forward +",
             "gather + sample), the busy % this simulation allows with no host time at all):"]
    head = key + " ".join(f"{p:>8}" for p in ("forward", "gather", "sample", "share", "bound %"))
    rows += [head, "-" * len(head)]
    for r in results:
        bound = 100 * r["forward"] / max(1e-9, r["forward"] + r["gather"] + r["dsample"])
        rows.append(start(r) + " ".join(f"{r[p]:>8.2f}" for p in ("forward", "gather", "dsample", "share"))
                    + f" {bound:>8.1f}")
    return "\n".join(rows)


def run_tp(tp: int, configs: list[tuple[int, float, bool, int]], warmup: int, steps: int) -> list[dict]:
    from launch.torchrun import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, tp, port, configs, warmup, steps, out), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    results = out.get(timeout=3600)
    for p in procs:
        p.join(timeout=60)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 sequences at TP=2 only")
    ap.add_argument("--tp", type=int, nargs="+", default=None)
    ap.add_argument("--seqs", type=int, nargs="+", default=None)
    ap.add_argument("--step-ms", type=float, nargs="+", default=[2.0, 5.0])
    ap.add_argument("--burst", type=int, default=8,
                    help="also run overlapped with multi-step decode (decode_burst) of this many forwards; 1: not")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=None, help="measured steps per configuration")
    args = ap.parse_args()
    tps = args.tp or ([2] if args.quick else [2, 4])
    seqs = args.seqs or ([256] if args.quick else [8, 64, 256, 512])
    steps = args.steps or (150 if args.quick else 100)
    modes = [(False, 1), (True, 1)] + ([(True, args.burst)] if args.burst > 1 else [])
    configs = [(n, ms, ov, k) for n in seqs for ms in args.step_ms for ov, k in modes]
    results = []
    for tp in tps:
        results += run_tp(tp, configs, args.warmup, steps)
    print()
    print(table(results))
    print()
    for r in results:
        print(line(r))


if __name__ == "__main__":
    main()
