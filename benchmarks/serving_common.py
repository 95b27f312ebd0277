"""What both sides of benchmarks/serving.py share: the workload constants, printing, and how busy the
machine was (other processes' CPU time while an engine ran, and a quick speed probe)."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

PAGE = 256  # page_size: both engines' default
WARM_TOKENS = 8
NUM_WARM = 4


def say(*args) -> None:
    print(*args, flush=True)


def cpu_busy_s() -> float:
    """Busy CPU seconds of the whole machine since boot (every process, ours and others'), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)  # user nice system irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of every descendant it has reaped (their own reaped children included)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def speed_probe() -> float:
    """The machine's speed right now: a fixed torch matmul (16 x 768 by 768 x 32000, the small model's LM head at
    a decode batch of 16, memory-bound), median of 15, in this process's torch threads. Other guests on the
    same host or a busy neighbour slow it without showing in the load average."""
    import torch

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(32000, 768, generator=g), torch.randn(16, 768, generator=g)
    times = []
    for _ in range(17):
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - t)
    return 1000 * sorted(times[2:])[7]


class CpuWindow:
    """How much CPU other processes used while one engine ran: machine busy time minus ours."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.monotonic(), cpu_busy_s(), own_cpu_s()

    def others(self) -> tuple[float, float]:
        """(other processes' CPU seconds, the window's wall seconds)."""
        return max(0.0, (cpu_busy_s() - self.busy0) - (own_cpu_s() - self.own0)), time.monotonic() - self.t0


def on_arrivals(arrivals: list[float], one: Callable[[int, float], None]) -> float:
    """Start `one(i, t0)` on its own thread at t0 + arrivals[i] (t0: a moment from now) and wait for them all;
    returns t0."""
    threads = []
    t0 = time.perf_counter() + 0.05
    for i, a in enumerate(arrivals):
        delay = t0 + a - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=one, args=(i, t0), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return t0


def client_message(target: Callable[..., None], args: tuple, timeout: float, what: str) -> dict:
    """Run `target(*args, out_q)` in a spawned process and return the message it puts on out_q (its `records`
    and whatever else it reports; RuntimeError naming `what` if it reports an error or sends nothing within
    `timeout` s)."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    client = ctx.Process(target=target, args=(*args, out_q))
    client.start()
    try:
        msg = out_q.get(timeout=timeout)
    except queue.Empty:
        msg = {"error": f"the client sent nothing within {timeout}s"}
    client.join(30)
    if client.is_alive():
        client.kill()
        client.join(5)
    if "error" in msg:
        raise RuntimeError(f"{what} failed: {msg['error']}")
    return msg


def preset_toml(args) -> str:
    """`lockstep serve`'s preset for a benchmark's arguments. `page_size`, `max_requests_per_batch` and
    `prefix_caching` are optional on `args` (benchmarks/peer_vllm_serving.py sets them to match vLLM's server);
    without them: PAGE, the server's default, and its default block sharing."""
    lines = ["[continuous_batching]", f"page_size = {getattr(args, 'page_size', PAGE)}",
             f"num_blocks = {args.num_blocks}", "cpu_group_timeout = 120.0"]
    if getattr(args, "max_requests_per_batch", None):
        lines.append(f"max_requests_per_batch = {args.max_requests_per_batch}")
    if getattr(args, "prefix_caching", None) is False:
        lines.append("allow_block_sharing = false")
    if args.model_samples:  # greedy must then be asked per request, which needs per-request processors
        lines.append("per_request_processors = true")
    if args.max_batch_tokens:
        lines.append(f"max_batch_tokens = {args.max_batch_tokens}")
    return "\n".join(lines) + "\n"
