"""N local ranks of a test script, started as torchrun starts them but without torchrun's own process.

torchrun's agent imports torch (about 2 CPU-s a launch) and polls its workers every 0.1 s; the tests start some
twenty groups a run. Here the test process starts the ranks itself, with the environment torchrun gives a worker of a
single-node group (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT), and keeps torchrun's rule for a failure: when one rank exits non-zero, the others are
killed and the group's exit code is non-zero. What users run (`lockstep serve`, `lockstep run`, a torchrun script)
is still started through torchrun in the tests that cover it (tests/serving.py, test_cli, test_transformers_script).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch.torchrun import free_port


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun puts in a worker's environment, for rank `rank` of a one-node group of `nproc`."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0"}


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank and whatever it started (its own session)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


def run_local_ranks(path: Path, args: list[str], nproc: int, timeout: float,
                    env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -u path args` on `nproc` ranks, their stdout and stderr together; the exit code is the first failing
    rank's (0 when all succeed). On a rank's failure the others are killed; on timeout all are, and AssertionError
    says so with the output."""
    port = free_port()
    cmd = [sys.executable, "-u", str(path), *args]
    with tempfile.TemporaryFile("w+") as out:
        procs = [subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                  env=dict(env, **rank_env(rank, nproc, port))) for rank in range(nproc)]
        failed = None
        deadline = time.monotonic() + timeout
        try:
            # every rank polled each time, as torchrun's agent does: a dead rank is reaped (a zombie still answers
            # kill(pid, 0): cluster/host_all_reduce.py would not see it gone)
            while failed is None and None in [p.poll() for p in procs]:
                failed = next((p.returncode for p in procs if p.returncode not in (None, 0)), None)
                if time.monotonic() > deadline:
                    _kill(procs)
                    out.seek(0)
                    raise AssertionError(f"{path.name} timed out after {timeout}s:\n{out.read()[-4000:]}")
                time.sleep(0.05)
            failed = failed or next((p.returncode for p in procs if p.returncode), 0)
        finally:
            _kill(procs)
        out.seek(0)
        return subprocess.CompletedProcess(cmd, failed, out.read(), "")
