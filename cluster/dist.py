"""Process groups and the control channel. The device group carries the forward's all-reduces (NCCL on CUDA,
gloo on CPU), the control group StepPlans and agreements (gloo, `cpu_group_timeout`); with LOCKSTEP_PLAN_CHANNEL=1
ranks on one host take each plan's frame through shared memory instead (cluster/plan_channel.py). Alone
(WORLD_SIZE unset or 1) there is no process group at all."""

from __future__ import annotations

import atexit
import os
import platform
import threading
import uuid
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from cluster.config import PLAN_CHANNEL_ENV
from cluster.plan import HEADER_LEN, MIN_INLINE, PLAN_MAGIC, Command, H, StepPlan, plan_from_parts
from cluster.plan_channel import PlanChannel
from cluster.shared_segment import SHM_DIR, SharedSegment, pid_alive

DRIVER = 0
NO_TIMEOUT = timedelta(days=7)
# how long ranks may take to reach one another when the groups form (imports, checkpoint reads, a loaded host),
# whatever the collectives' own timeout: a 5 s failure timeout must not fail a start that is merely slow
JOIN_TIMEOUT = timedelta(seconds=300)


class ControlThreadError(RuntimeError):
    """A thread other than the loop's tried to use the control group: a lockstep invariant broke."""


@dataclass
class Groups:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    device_group: dist.ProcessGroup | None = None
    control_group: dist.ProcessGroup | None = None
    owns_default_group: bool = False
    control_timeout: float | None = 300.0
    owns_control_group: bool = False
    # the lockstep rule "only the loop thread talks on the control group", checked by every call below:
    control_owner: threading.Thread | None = None  # the loop thread while a loop runs (None: whoever calls)
    control_lent: bool = False  # a pause lends the channel to the callers holding it, between its barriers
    plan_channel: PlanChannel | None = None  # ranks on one host: plans' frames through shared memory
    owns_plan_channel: bool = False

    @contextmanager
    def owned_by_this_thread(self) -> Iterator[None]:
        """Make the calling thread (a manager's loop) the only one allowed on the control group. Its starter
        names it owner before it starts (`control_owner = thread`), so no caller slips in before it runs."""
        self.control_owner = threading.current_thread()
        try:
            yield
        finally:
            self.control_owner = None

    @contextmanager
    def lent(self) -> Iterator[None]:
        """While a pause parks the loop, the pause's holders may run collectives (weight updates) too."""
        self.control_lent = True
        try:
            yield
        finally:
            self.control_lent = False

    def check_control_thread(self) -> None:
        """Raise if this thread may not talk on the control group now (see docs/architecture.md)."""
        owner = self.control_owner
        if owner is not None and owner is not threading.current_thread() and not self.control_lent:
            raise ControlThreadError(f"rank {self.rank}: thread {threading.current_thread().name!r} used the control "
                                     f"group while the loop thread owns it: only the loop thread sends or receives "
                                     f"plans and agreements, or a pause's holders while the loop is parked")

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def destroy(self) -> None:
        """Free the groups this object made. Idempotent; every rank calls it."""
        if self.owns_control_group and self.control_group is not None and dist.is_initialized():
            dist.destroy_process_group(self.control_group)
        if self.owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        if self.plan_channel is not None and self.owns_plan_channel:
            self.plan_channel.close()
        self.device_group = self.control_group = self.plan_channel = None
        self.owns_default_group = self.owns_control_group = self.owns_plan_channel = False


def pick_device(local_rank: int, device: str | torch.device | None = None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def group_timeouts(cpu_group_timeout: float | None) -> tuple[timedelta, timedelta]:
    """(the timeout a formed group's collectives fail after, the longer one it may take to form: JOIN_TIMEOUT, where
    this torch can shorten a group's timeout once formed)."""
    timeout = timedelta(seconds=cpu_group_timeout) if cpu_group_timeout else NO_TIMEOUT
    can_settle = hasattr(dist.distributed_c10d, "_set_pg_timeout")  # torch >= 2.3
    return timeout, max(timeout, JOIN_TIMEOUT) if can_settle else timeout


def settle_timeout(groups: tuple, timeout: timedelta, join: timedelta) -> None:
    """Formed: from now on the collectives of `groups` fail after `timeout`. Every member calls it."""
    if join != timeout:
        for group in groups:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def init_groups(cpu_group_timeout: float | None = 300.0, device: str | torch.device | None = None) -> Groups:
    """Join the groups torchrun (or the Ray launcher) describes in the environment. Every rank calls it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(local_rank, device)
    if world == 1:
        return Groups(rank=0, world_size=1, local_rank=0, device=dev)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout, join = group_timeouts(cpu_group_timeout)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=join,
                                device_id=dev if dev.type == "cuda" else None)
    device_group = dist.group.WORLD
    control_group = dist.new_group(backend="gloo", timeout=join)
    settle_timeout((device_group, control_group) if owns else (control_group,), timeout, join)
    groups = Groups(rank=rank, world_size=world, local_rank=local_rank, device=dev, device_group=device_group,
                    control_group=control_group, owns_default_group=owns, control_timeout=cpu_group_timeout,
                    owns_control_group=True)
    segment = join_shared_segment(groups, PlanChannel.body_bytes(), "plans",
                                  os.environ.get(PLAN_CHANNEL_ENV, "0") == "1")
    groups.plan_channel, groups.owns_plan_channel = (None, False) if segment is None else (PlanChannel(segment), True)
    # tear the groups down before interpreter shutdown: gloo's threads must not outlive their owners
    atexit.register(groups.destroy)
    return groups


def make_control_group(groups: Groups, cpu_group_timeout: float | None) -> Groups:
    """The same ranks with a fresh control group of another timeout. Every rank calls it."""
    timeout, _ = group_timeouts(cpu_group_timeout)
    return replace(groups, control_group=dist.new_group(backend="gloo", timeout=timeout),
                   control_timeout=cpu_group_timeout, owns_default_group=False, owns_control_group=True,
                   owns_plan_channel=False)  # the same ranks share the plan channel


def join_shared_segment(groups: Groups, body_bytes: int, tag: str, wanted: bool) -> SharedSegment | None:
    """One shared-memory segment of `body_bytes` for the group (cluster/shared_segment.py), or None on every rank
    alike where it cannot be: not `wanted` on some rank, not x86-64, no writable /dev/shm, or ranks that do not map
    one segment (other hosts) or cannot see each other's processes. The segment is unlinked once every rank has
    mapped it. Every rank calls it."""
    if not groups.distributed:
        return None
    wanted = wanted and platform.machine().lower() in ("x86_64", "amd64")
    if not all(agree_all_ok(wanted, groups)):
        return None
    path = ""
    if groups.is_driver:
        path = os.path.join(SHM_DIR, f"lockstep-{tag}-{uuid.uuid4().hex}")
        try:
            with open(path, "xb") as f:
                f.truncate(SharedSegment.size(groups.world_size, body_bytes))
        except OSError:  # no writable /dev/shm
            path = ""
    path = agree_messages(path, groups)[0]
    segment, ok = None, bool(path)
    if ok:
        try:
            segment = SharedSegment(path, groups.rank, groups.world_size, body_bytes)
            segment.pids[groups.rank] = os.getpid()
        except OSError:
            ok = False
    ok = all(agree_all_ok(ok, groups))  # after it, every rank has written its pid
    if groups.is_driver and path:
        os.unlink(path)  # mapped everywhere (or given up): the name is no longer needed
    if ok:  # one segment and one pid namespace: every rank sees every peer's pid alive
        ok = all(pid > 0 and pid_alive(int(pid)) for pid in segment.pids)
        ok = all(agree_all_ok(ok, groups))
    if not ok and segment is not None:
        segment.close()
    return segment if ok else None


# payload words the next frame of each control group has room for: both ends set it from every header, so a
# receiver knows the frame's size before it arrives (weak keys: a destroyed group's entry goes with it)
_inline_room: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def inline_words(needed: int, room: int) -> int:
    """The room the next frame announces, after a plan of `needed` payload words in a frame with `room`: a quarter
    more than needed, kept while it is at most four times what is needed (a batch that grows or shrinks by a few
    rows does not resize every frame)."""
    want = max(MIN_INLINE, -(-needed * 5 // 4 // 256) * 256)
    return room if want <= room <= 4 * want else want


def live_channel(groups: Groups) -> PlanChannel | None:
    """The plan channel this plan takes: none after an IDLE plan, whose next plan (a heartbeat half a second on, or
    the first work after it) goes over gloo, where a waiting worker blocks rather than polls. Both ends know the
    last plan's command, so they agree."""
    channel = groups.plan_channel
    return None if channel is None or channel.after_idle else channel


def remember_command(groups: Groups, command: Command) -> None:
    """Note the plan just sent or received, for `live_channel`: both ends call it for every plan."""
    if groups.plan_channel is not None:
        groups.plan_channel.after_idle = command == Command.IDLE


def send_plan(plan: StepPlan, groups: Groups) -> np.ndarray | None:
    """Send one plan from the driver; returns every rank's state row (the driver's: the plan's header) when the plan
    gathers them (`plan.gather`), else None. The driver calls it; every other rank calls `recv_plan` once for it.
    One frame (through the plan channel where one was joined, else one gloo broadcast) carries the header and, when it
    fits, the payload; the rest only when the header announces it (docs/architecture.md, "The StepPlan")."""
    groups.check_control_thread()
    if not groups.distributed:
        return None
    channel = live_channel(groups)
    remember_command(groups, plan.command)
    room = channel.room if channel else _inline_room.get(groups.control_group, MIN_INLINE)
    header = plan.header()
    n = int(header[H.PAYLOAD_LEN])
    header[H.NEXT_INLINE] = room if channel else inline_words(n, room)
    words = room if channel is None else n if n <= room else 0  # a channel's frame is as long as its payload
    frame = np.zeros(HEADER_LEN + -(-words // 2), np.int64)
    frame[:HEADER_LEN] = header
    payload = plan.payload() if n else None
    if payload is not None and n <= room:
        frame[HEADER_LEN:].view(np.int32)[:n] = payload
    if channel:
        channel.post(frame, groups.control_timeout)
    else:
        dist.broadcast(torch.from_numpy(frame), DRIVER, group=groups.control_group)
        _inline_room[groups.control_group] = int(header[H.NEXT_INLINE])
    if payload is not None and n > room:
        dist.broadcast(torch.from_numpy(payload), DRIVER, group=groups.control_group)
    if plan.data:
        dist.broadcast(torch.frombuffer(bytearray(plan.data), dtype=torch.uint8), DRIVER, group=groups.control_group)
    if not plan.gather:
        return None
    if channel:
        states = channel.states(HEADER_LEN, groups.control_timeout)
        states[DRIVER] = header
        return states
    rows = [torch.zeros(HEADER_LEN, dtype=torch.int64) for _ in range(groups.world_size)]
    dist.gather(torch.zeros(HEADER_LEN, dtype=torch.int64), rows, dst=DRIVER, group=groups.control_group)
    rows[DRIVER] = torch.from_numpy(header)  # the others: their state rows
    return torch.stack(rows).numpy()


def recv_plan(groups: Groups, state: np.ndarray) -> StepPlan:
    """The driver's next plan, telling it this rank's `state` row when the plan gathers them. Every non-driver rank
    calls it once per `send_plan`."""
    groups.check_control_thread()
    channel = live_channel(groups)
    if channel:
        frame, room = channel.take(np.asarray(state, dtype=np.int64), groups.control_timeout), channel.room
    else:
        room = _inline_room.get(groups.control_group, MIN_INLINE)
        frame = np.zeros(HEADER_LEN + -(-room // 2), np.int64)
        dist.broadcast(torch.from_numpy(frame), DRIVER, group=groups.control_group)
    h = frame[:HEADER_LEN]
    is_plan = int(h[H.MAGIC]) == PLAN_MAGIC  # if not, plan_from_parts says so; nothing more is received
    n = int(h[H.PAYLOAD_LEN]) if is_plan else 0
    if is_plan and not channel:
        _inline_room[groups.control_group] = int(h[H.NEXT_INLINE])
    if n <= room:
        payload = frame[HEADER_LEN:].view(np.int32)[:n]
    else:
        payload = torch.empty(n, dtype=torch.int32)
        dist.broadcast(payload, DRIVER, group=groups.control_group)
        payload = payload.numpy()
    data = torch.empty(int(h[H.DATA_LEN]) if is_plan else 0, dtype=torch.uint8)
    if data.numel():
        dist.broadcast(data, DRIVER, group=groups.control_group)
    plan = plan_from_parts(h, payload, data.numpy().tobytes())
    remember_command(groups, plan.command)
    if plan.gather and not channel:
        row = torch.zeros(HEADER_LEN, dtype=torch.int64)
        row[:len(state)] = torch.from_numpy(np.asarray(state, dtype=np.int64))
        dist.gather(row, None, dst=DRIVER, group=groups.control_group)
    return plan


def agree_min(value: int, groups: Groups) -> int:
    """The smallest of every rank's value. Every rank calls it."""
    groups.check_control_thread()
    if not groups.distributed:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=groups.control_group)
    return int(t.item())


def agree_all_ok(ok: bool, groups: Groups) -> list[bool]:
    """Every rank's OK flag, so that all ranks take the same branch. Every rank calls it."""
    groups.check_control_thread()
    if not groups.distributed:
        return [ok]
    t = torch.zeros(groups.world_size, dtype=torch.int64)
    t[groups.rank] = int(ok)
    dist.all_reduce(t, group=groups.control_group)
    return [bool(x) for x in t.tolist()]


def agree_messages(message: str, groups: Groups, max_bytes: int = 1024) -> list[str]:
    """Every rank's message (empty: all is well), as plain bytes in a tensor. Every rank calls it."""
    groups.check_control_thread()
    raw = message.encode()[:max_bytes]
    if not groups.distributed:
        return [raw.decode(errors="replace")]
    table = torch.zeros(groups.world_size, max_bytes, dtype=torch.uint8)
    if raw:
        table[groups.rank, :len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.all_reduce(table, group=groups.control_group)
    return [bytes(row[row != 0].tolist()).decode(errors="replace") for row in table]


def agree_figures(values: list[int], groups: Groups) -> list[list[int]]:
    """Every rank's row of integers (all rows of one length), e.g. memory figures. Every rank calls it."""
    groups.check_control_thread()
    if not groups.distributed:
        return [list(values)]
    table = torch.zeros(groups.world_size, len(values), dtype=torch.int64)
    table[groups.rank] = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(table, group=groups.control_group)
    return table.tolist()
