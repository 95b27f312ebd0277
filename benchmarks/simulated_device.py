"""The simulated device of benchmarks/control_plane.py: a real ModelRunner whose forward is a fixed device time.

Everything a rank does around the forward is the real code (ModelRunner.prepare into the static buffers, the KV
page copies, a burst's advance, the sampler's launch), run in order by one worker.stream.ThreadStream thread a
rank, which issues the device work. The forward is a fixed `step_s` on a virtual device clock
(`SimulatedForward`): as on a CUDA stream, the thread goes on to the next step's work while the device is busy,
and the host sees a step's sampled tokens once the clock has passed the step's end (`VirtualEvent`, standing in
for the CUDA event of the sampler's transfer to the host). The LM head is `FakeHead` on small fake logits (vocab
256); where its collective runs is a choice:

- `device` (the default): inside the fixed step time, as on a GPU, where the head's NCCL gather and broadcast
  run on the device like every other collective of the forward and take no host CPU. Every rank holds the same
  fake logits, so each takes the greedy tokens itself and no process waits for another.
- `gloo`: the real shard argmax (worker/shard_argmax.py: a gather and a broadcast over the gloo device group)
  on the simulated device thread, which then pays that collective's CPU time and its waits for the other ranks
  in the two cores it shares with the hosts.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from driver.engine import sampler as sampler_module
from worker.layers import Shard
from worker.runner import ModelRunner
from worker.shard_argmax import ShardArgmax, shard_argmax
from worker.stream import ThreadStream

VOCAB = 256
HEAD_COLLECTIVES = ("device", "gloo")


class FakeHead:
    """Stands in for the model's ParallelLMHead on fake logit shards: a gather, or (plain greedy rows, as in the
    benchmark) the argmax on the shards, over gloo or inside the device step (see the module docstring). Its
    collective closes the step's window (`SimulatedForward.pace`) in series, and overlapped when no token
    broadcast follows. Every rank of the device group calls `gather` or `argmax`."""

    def __init__(self, shard: Shard, collective: str):
        assert collective in HEAD_COLLECTIVES, collective
        self.shard, self.on_gloo = shard, collective == "gloo"
        self.vocab_size = VOCAB
        self.forward: SimulatedForward | None = None

    def gather(self, local: torch.Tensor) -> torch.Tensor | None:
        return self.paced(self.collective(local), not self.forward.overlapped)

    def argmax(self, local: torch.Tensor) -> ShardArgmax:
        return self.paced(self.collective(local, chosen=True), True)

    def paced(self, out: Any, last: bool) -> Any:
        return (self.forward.pace(), out)[1] if last else out

    def collective(self, local: torch.Tensor, chosen: bool = False) -> Any:
        rank, size, group = self.shard.rank, self.shard.size, self.shard.group
        if not self.on_gloo:  # every rank holds every shard's logits: the collective's result without its traffic
            full = self.forward.full[:local.shape[0]]
            if chosen:
                best, ids = full.max(-1)
                return ShardArgmax(best if rank == 0 else None, ids)
            return full if rank == 0 else None
        if chosen or size == 1:
            return shard_argmax(local, rank * local.shape[-1], VOCAB, rank, size, group) if chosen else local
        parts = [torch.empty_like(local) for _ in range(size)] if rank == 0 else None
        dist.gather(local, parts, dst=0, group=group)
        return None if parts is None else torch.cat(parts, dim=-1)


class FakeModel:
    """What ModelRunner reads of a model: the layer count, the head, whether its cache holds values (per-head K/V, as
    every family but MLA's); the forward is `SimulatedForward`."""

    kv_values = True

    def __init__(self, shard: Shard, collective: str):
        self.config = type("Config", (), {"num_hidden_layers": 1})()
        self.lm_head = FakeHead(shard, collective)


class VirtualEvent:
    """The simulated device's CUDA event: `synchronize` waits until the device's clock reaches `at`; `waited_s`
    sums those waits (the host's waits for the device, in the benchmark's host timings)."""

    waited_s = 0.0

    def __init__(self, at: float):
        self.at = at

    def synchronize(self) -> None:
        t0 = time.perf_counter()
        if self.at > t0:
            time.sleep(self.at - t0)
            VirtualEvent.waited_s += time.perf_counter() - t0


class SimulatedForward:
    """The simulated device's steps, each a fixed `step_s` on a virtual device clock. A step starts when the
    device is free and the launching thread (the ThreadStream's) has issued its first device op (whichever is
    later: the device then idles, `late_s`), and ends `step_s` later, or when its last op is issued if that is
    later (`overrun_s`: the launching thread slower than the device). Between them the step's device work runs
    here for real (page copies, shared ids or a burst's advance, the stand-in forward, the head, sampling).

    As on a CUDA stream the launching thread does not wait for the device: it goes on to the next step's ops
    (`ahead_s` sums its lead), and the host sees a step's results only when the device clock has passed its end
    (`VirtualEvent`, in place of the CUDA event of the sampler's transfer to the host). `queue=False` is the
    synchronous model instead: the thread waits for each step's end before the next step's ops."""

    def __init__(self, tp: int, rank: int, rows: int, queue: bool = True):
        self.full = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0))  # the same on every rank
        self.logits = self.full[:, rank * VOCAB // tp:(rank + 1) * VOCAB // tp]
        self.queue = queue
        self.step_s = 0.005
        self.overlapped = False  # which op closes the window: the token broadcast (True) or the gather
        self.calls = 0
        self.opened: float | None = None  # the running step's start (device clock)
        self.closed = time.perf_counter()  # when the last step ended (device clock)
        self.reset_counts()

    def reset_counts(self) -> None:
        """Start summing overrun, late and ahead (see the class docstring) anew."""
        self.overrun_s = self.late_s = self.ahead_s = 0.0

    def open(self) -> None:
        """The step's first device op is issued (before its forward, or at it)."""
        if self.opened is None:
            self.opened = max(self.closed, time.perf_counter())
            self.late_s += self.opened - self.closed

    def __call__(self, ids: torch.Tensor, meta: Any) -> torch.Tensor:
        self.calls += 1
        self.open()
        return self.logits[:meta.logits_idx.numel()]

    def pace(self) -> None:
        """The step's last device op is issued: the step ends (device clock)."""
        assert self.opened is not None, "pace() without a step"
        end, now = self.opened + self.step_s, time.perf_counter()
        if end < now:
            self.overrun_s += now - end
        elif self.queue:
            self.ahead_s += end - now
        else:
            self.sleep(end - now)
        self.closed, self.opened = max(end, now), None

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def events(self, to_host: Callable) -> Callable:
        """`driver.engine.sampler.to_host` whose transfer completes when the device clock passes the last step's end."""
        def transferred(picks: Any) -> tuple:
            host, event, *rest = to_host(picks)  # rest: the top tokens' transfer, which the event covers too
            return host, event if event is not None else VirtualEvent(self.closed), *rest
        return transferred


def build_runner(rc: Any, groups: Any, collective: str, queue: bool) -> tuple[ModelRunner, SimulatedForward]:
    """A ModelRunner on the simulated device, the head's collective on `collective` (HEAD_COLLECTIVES), the device
    a queue or synchronous (`SimulatedForward`). The host's reads of sampled tokens wait for the device clock."""
    shard = Shard(groups.rank, groups.world_size, groups.device_group)
    runner = ModelRunner(FakeModel(shard, collective), rc, kv_heads=1, head_dim=8, dtype=torch.float16,
                         device=torch.device("cpu"))
    runner.row_views = False  # lay steps out as a GPU host does (key-slot lists), not as the eager CPU forward
    runner.stream = ThreadStream(runner.device)
    forward = SimulatedForward(groups.world_size, groups.rank, rc.max_requests_per_batch, queue)
    sampler_module.to_host = forward.events(sampler_module.to_host)
    runner.forward_fn = forward
    runner.model.lm_head.forward = forward
    share = runner._share

    def paced_share(tokens: Any) -> Any:  # overlapped, the token broadcast closes the step's window
        handle = share(tokens)
        runner.stream.submit(forward.pace)
        return handle

    runner._share = paced_share
    for name in ("_advance", "_resolve_ids"):  # a step's device work before its forward is in its window
        setattr(runner, name, opening(forward, getattr(runner, name)))
    runner.cache.apply_swaps = opening(forward, runner.cache.apply_swaps)
    return runner, forward


def opening(forward: SimulatedForward, fn: Callable) -> Callable:
    def opened(*args: Any) -> Any:
        forward.open()
        return fn(*args)
    return opened
