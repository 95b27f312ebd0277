"""N local ranks of a test script, started as torchrun starts them but without torchrun's own process.

torchrun's agent imports torch (about 2 CPU-s a launch) and polls its workers every 0.1 s; the tests start some
twenty groups a run. Here the test process starts the ranks itself, with the environment torchrun gives a worker of a
single-node group (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT), and keeps torchrun's rule for a failure: when one rank exits non-zero, the others are
killed and the group's exit code is non-zero. What users run (`lockstep serve`, `lockstep run`, a torchrun script)
is still started through torchrun in the tests that cover it (tests/serving.py, test_cli, test_transformers_script).

The ranks are forked from a zygote (tests/rank_zygote.py) that imported torch and transformers once: ~3 CPU-s of
imports a rank spared, each rank still a process of its own.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from launch.torchrun import free_port
from tests.process_guard import refuse_unless_slow


REPO = Path(__file__).resolve().parents[1]


def ranks_base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the tests' ranks and servers: this one, one OpenMP thread, the repository importable (one
    zygote serves all that share it)."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(extra or {}))


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun puts in a worker's environment, for rank `rank` of a one-node group of `nproc`."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0"}


class ForkedRank:
    """A rank forked by a zygote (tests/rank_zygote.py), with the part of Popen's interface run_local_ranks uses."""

    def __init__(self, zygote: "Zygote", pid: int):
        self.zygote, self.pid = zygote, pid

    @property
    def returncode(self) -> int | None:
        return self.zygote.exits.get(self.pid)

    def poll(self) -> int | None:
        self.zygote.read_exits()
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


class Zygote:
    """One tests/rank_zygote.py process, started with the ranks' environment; forks ranks on request."""

    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-u", str(ZYGOTE)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        os.set_blocking(self.proc.stdout.fileno(), False)  # type: ignore[union-attr]
        self.exits: dict[int, int] = {}
        self.pending = b""
        self.lock = threading.Lock()

    def _messages(self, wait: bool) -> list[dict]:
        out: list[dict] = []
        while not out:
            try:
                data = os.read(self.proc.stdout.fileno(), 1 << 16)  # type: ignore[union-attr]
            except BlockingIOError:
                data = None
            if data == b"":
                raise RuntimeError(f"the rank zygote exited (code {self.proc.wait()})")
            self.pending += data or b""
            while b"\n" in self.pending:
                line, self.pending = self.pending.split(b"\n", 1)
                out.append(json.loads(line))
            if not wait:
                break
            if not out:
                select.select([self.proc.stdout], [], [], 1.0)
        return out

    def _note(self, messages: list[dict]) -> list[int]:
        pids = []
        for m in messages:
            if "exit" in m:
                self.exits[m["exit"]] = m["code"]
            else:
                pids.append(m["pid"])
        return pids

    def read_exits(self) -> None:
        with self.lock:
            self._note(self._messages(wait=False))

    def fork(self, target: Path | str, args: list[str], env: dict[str, str], out: str) -> ForkedRank:
        """Fork a rank running `target`: a script's path, or a module's name (a str), run as `python -m`."""
        where = {"path": str(target)} if isinstance(target, Path) else {"module": target}
        request = {**where, "args": args, "env": env, "cwd": os.getcwd(), "out": out}
        with self.lock:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            pids: list[int] = []
            while not pids:
                pids = self._note(self._messages(wait=True))
        return ForkedRank(self, pids[0])


ZYGOTE = Path(__file__).resolve().parent / "rank_zygote.py"
# set for each rank in its child; PYTEST_CURRENT_TEST changes with every test and nothing imported reads it
PER_RANK = (*rank_env(0, 1, 0), "PYTEST_CURRENT_TEST")
ZYGOTES_KEPT = 3  # the environments most recently used (most launches share one; a few tests add a variable)
_zygotes: dict[frozenset, Zygote] = {}


def zygote_for(env: dict[str, str]) -> Zygote:
    """The zygote started with `env` (less PER_RANK): started on first use, kept while among the last ZYGOTES_KEPT
    environments used (an older one's stdin is closed: it exits)."""
    base = {k: v for k, v in env.items() if k not in PER_RANK}
    key = frozenset(base.items())
    zygote = _zygotes.pop(key, None)
    if zygote is None or zygote.proc.poll() is not None:
        zygote = Zygote(base)
    _zygotes[key] = zygote  # the most recent last
    while len(_zygotes) > ZYGOTES_KEPT:
        _zygotes.pop(next(iter(_zygotes))).proc.stdin.close()  # type: ignore[union-attr]
    return zygote


def fork_ranks(target: Path | str, args: list[str], nproc: int, env: dict[str, str], out: str) -> list[ForkedRank]:
    """`nproc` ranks of `target` (Zygote.fork) with torchrun's environment, their output appended to `out`."""
    refuse_unless_slow("a forked rank", repr([target, *args]))  # the zygote forks it: this interpreter starts none
    port = free_port()
    zygote = zygote_for(env)
    return [zygote.fork(target, args, dict(env, **rank_env(rank, nproc, port)), out) for rank in range(nproc)]


def kill_ranks(procs: list[ForkedRank]) -> None:
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
    cmd = [sys.executable, "-u", str(path), *args]
    with tempfile.NamedTemporaryFile("w+") as out:
        procs = fork_ranks(path, args, nproc, env, out.name)
        failed = None
        deadline = time.monotonic() + timeout
        try:
            # every rank polled each time, as torchrun's agent does: a dead rank is reaped (a zombie still answers
            # kill(pid, 0): cluster/host_all_reduce.py would not see it gone)
            while failed is None and None in [p.poll() for p in procs]:
                failed = next((p.returncode for p in procs if p.returncode not in (None, 0)), None)
                if time.monotonic() > deadline:
                    kill_ranks(procs)
                    out.seek(0)
                    raise AssertionError(f"{path.name} timed out after {timeout}s:\n{out.read()[-4000:]}")
                time.sleep(0.05)
            failed = failed or next((p.returncode for p in procs if p.returncode), 0)
        finally:
            kill_ranks(procs)
        out.seek(0)
        return subprocess.CompletedProcess(cmd, failed, out.read(), "")
