"""One rank of tests/test_late_join.py. Rank 1 starts LATE seconds after rank 0 (argv[1]; a Ray actor or a process
slow to start on a loaded host), then both join the default group as `lockstep serve` does
(launch/serve.py `join_attempt_group`) under a 1 s cpu_group_timeout. Then rank 0 runs a barrier that rank 1 skips
(staying alive) and prints how long the barrier took to fail: once formed, the group's collectives fail after the
configured timeout, not the longer one it was allowed to form under."""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist

from launch.serve import join_attempt_group

CPU_GROUP_TIMEOUT = 1.0


def main(late: float) -> None:
    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(late)
    join_attempt_group(CPU_GROUP_TIMEOUT)
    print(f"rank {rank} joined", flush=True)
    if rank == 0:
        start = time.monotonic()
        try:
            dist.barrier()
            print("the barrier passed", flush=True)
        except RuntimeError:
            print(f"the barrier failed after {time.monotonic() - start:.1f} s", flush=True)
    else:
        time.sleep(3 * CPU_GROUP_TIMEOUT)  # alive, and not in the barrier
    os._exit(0)  # the group is broken on purpose: no orderly teardown


if __name__ == "__main__":
    main(float(sys.argv[1]))
