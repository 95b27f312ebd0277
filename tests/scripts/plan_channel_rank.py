"""One rank of the plan channel tests (cluster/plan_channel.py, cluster/dist.py `send_plan` / `recv_plan`). MODE:

- `plans`: the driver sends PLANS plans of many shapes (payloads inline and, through the channel, one longer than
  a frame's room; plans carrying data; plans that gather the state rows and plans that do not; IDLE heartbeats,
  after which a plan goes over gloo) while the workers
  start late, so the driver runs more than a ring's worth of plans ahead. Every worker checks every plan against
  the one it expects, field by field, and passes a state row naming the plan; the driver checks the gathered rows.
  Rank 0 writes whether the channel was made, the segment files left in /dev/shm, and whether every rank agreed.
- `driver_dies`: rank 0 exits before sending anything; rank 1 writes the error its `recv_plan` raised.
- `worker_dies`: the last rank exits; rank 0 sends a plan 0.3 s later and writes the error it got.
- `stalls`: the group's timeout is 2 s and rank 0 sends nothing for 6 s; rank 1 writes its error.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import numpy as np

PLANS = 40


def make_plan(i: int, room: int | None):
    """Plan i of the sequence (every rank builds the same); plan 7 is longer than a frame's `room` when given."""
    from cluster.plan import Command, StepPlan

    if i % 6 == 4 or i == 35:  # heartbeats, two in a row once: each sends the next plan over gloo
        return StepPlan(command=Command.IDLE, step=i)
    gen = np.random.default_rng(i)
    seqs = int(gen.integers(0, 300))
    width = int(gen.integers(1, 40)) if seqs else 0
    q_lens = np.ones(seqs, np.int32)
    if seqs:
        q_lens[seqs // 2:] = gen.integers(1, 20, seqs - seqs // 2)
    tokens = int(q_lens.sum()) + (room + 10 if i == 7 and room else 0)
    data = bytes(gen.integers(0, 256, int(gen.integers(1, 5000))).astype(np.uint8)) if i % 5 == 3 else b""
    return StepPlan(command=Command.PUBLISH if data else Command.STEP, step=i, weight_version=i % 3,
                    input_ids=gen.integers(0, 32000, tokens).astype(np.int32), q_lens=q_lens,
                    kv_lens=gen.integers(1, 4000, seqs).astype(np.int32),
                    sample=gen.integers(0, 2, seqs).astype(np.int32),
                    block_tables=gen.integers(0, 1000, (seqs, width)).astype(np.int32), data=data,
                    share_tokens=bool(i % 2), gather=bool(data) or i % 4 == 0)


def same_plan(a, b) -> bool:
    arrays = ("input_ids", "q_lens", "kv_lens", "sample", "block_tables", "swap_out", "swap_in", "page_copies",
              "score_next")
    return (all(np.array_equal(getattr(a, f), getattr(b, f)) for f in arrays)
            and (a.command, a.step, a.weight_version, a.data, a.share_tokens, a.gather)
            == (b.command, b.step, b.weight_version, b.data, b.share_tokens, b.gather))


def main(mode: str, out: str) -> None:
    from cluster.dist import agree_all_ok, init_groups, recv_plan, send_plan
    from cluster.plan import STATE_MAGIC, Command, StepPlan
    from cluster.shared_segment import SHM_DIR
    from driver.api.driver_loop import is_collective_error

    groups = init_groups(cpu_group_timeout=2.0 if mode == "stalls" else 60.0, device="cpu")
    rank, size, channel = groups.rank, groups.world_size, groups.plan_channel
    rec: dict = {"made": channel is not None, "left": glob.glob(os.path.join(SHM_DIR, "lockstep-plans-*"))}
    room = channel.room if channel is not None else None
    writer = 0
    if mode == "plans":
        ok = True
        if rank:
            time.sleep(0.3)  # the driver runs ahead, past the ring's slots
        for i in range(PLANS):
            want = make_plan(i, room)
            if rank == 0:
                states = send_plan(want, groups)
                if want.gather:
                    ok = ok and states is not None and states.shape[0] == size and all(
                        list(states[r, :3]) == [STATE_MAGIC, i, r] for r in range(1, size))
                else:
                    ok = ok and states is None
            else:
                ok = ok and same_plan(recv_plan(groups, np.array([STATE_MAGIC, i, rank])), want)
        rec.update(agree=all(agree_all_ok(ok, groups)), plans=PLANS, long=bool(room))
    else:
        victim = 0 if mode in ("driver_dies", "stalls") else size - 1
        writer = 1 if victim == 0 else 0
        if rank == victim:
            if mode == "stalls":
                time.sleep(6)
            os._exit(0)
        if rank == writer:
            if mode == "worker_dies":
                time.sleep(0.3)
            start = time.monotonic()
            try:
                if rank == 0:
                    send_plan(StepPlan(command=Command.IDLE), groups)
                else:
                    recv_plan(groups, np.zeros(3, np.int64))
                rec["error"] = None
            except Exception as e:  # noqa: BLE001 - what the test inspects
                rec.update(error=type(e).__name__, collective=is_collective_error(e), message=str(e))
            rec["waited_s"] = time.monotonic() - start
    if rank == writer:
        with open(out, "w") as f:
            json.dump(rec, f)
    os._exit(0)  # the groups may hold a dead peer: no teardown


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
