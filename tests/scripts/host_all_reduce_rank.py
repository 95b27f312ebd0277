"""One rank of the host all-reduce tests (cluster/host_all_reduce.py). MODE:

- `sums`: join with a small slot (so larger tensors go in pieces), reduce tensors of several shapes and dtypes
  and compare each with gloo's all-reduce of the same tensors; rank 0 writes a JSON record to OUT (whether
  every result equalled gloo's bit for bit, or was within rounding of it, whether every rank got the same bits,
  how many tensors, the segment file names left in /dev/shm, and whether the reducer was made at all).
- `dies`: the last rank exits before the first reduction; rank 0 writes the error it got (type, whether
  `is_collective_error` calls it a collective error, seconds it took).
- `stalls`: the last rank sleeps past the group's 2 s timeout before reducing; rank 0 writes the same.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main(mode: str, out: str) -> None:
    from cluster.dist import init_groups
    from cluster.host_all_reduce import HostAllReduce
    from cluster.shared_segment import SHM_DIR
    from driver.api.driver_loop import is_collective_error

    groups = init_groups(cpu_group_timeout=2.0 if mode == "stalls" else 60.0, device="cpu")
    rank, size = groups.rank, groups.world_size
    reducer = HostAllReduce.join(groups, slot_bytes=4096)
    rec: dict = {"made": reducer is not None, "left": glob.glob(os.path.join(SHM_DIR, "lockstep-allreduce-*"))}
    if mode == "sums":
        same, close, agree, count = True, True, True, 0
        gen = torch.Generator().manual_seed(rank)
        for shape, dtype in [((64, 768), torch.float32), ((1, 7), torch.float32), ((3, 1000), torch.bfloat16),
                             ((5000,), torch.float32), ((2, 2), torch.int64)]:
            for _ in range(3):
                x = (torch.randn(shape, generator=gen) * 100).to(dtype)
                want = x.clone()
                dist.all_reduce(want, group=groups.device_group)
                if reducer is not None:
                    got = reducer.all_reduce(x)
                    same = same and got is x and torch.equal(got, want)
                    atol = 8.0 if dtype == torch.bfloat16 else 1e-3  # a few bf16 ulps of sums up to ~400
                    close = close and torch.allclose(got.double(), want.double(), rtol=1e-2, atol=atol)
                    everyone = [torch.empty_like(got) for _ in range(size)]
                    dist.all_gather(everyone, got, group=groups.device_group)
                    agree = agree and all(torch.equal(e, everyone[0]) for e in everyone)
                count += 1
        rec.update(same=same, close=close, agree=agree, count=count)
        if reducer is not None:  # the exchange without sums: every rank's bits, in rank order; a slot at most
            rec["gathered"] = reducer.all_gather(torch.full((3,), rank + 0.5)).tolist()
            rec["too_big"] = reducer.all_gather(torch.zeros(2048)) is None  # 8 KB against a 4 KB slot
    elif reducer is not None:
        last = rank == size - 1
        if last and mode == "dies":
            os._exit(0)
        if last and mode == "stalls":
            time.sleep(6)
        start = time.monotonic()
        try:
            reducer.all_reduce(torch.ones(4))
            rec["error"] = None
        except Exception as e:  # noqa: BLE001 - what the test inspects
            rec.update(error=type(e).__name__, collective=is_collective_error(e), message=str(e))
        rec["waited_s"] = time.monotonic() - start
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rec, f)
    os._exit(0)  # the groups may hold a dead peer: no teardown


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
