"""Start a real `lockstep serve` for a test and stop every process it started."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from launch.torchrun import free_port
from tests.conftest import REPO


class Server:
    def __init__(self, proc: subprocess.Popen, address: str, lines: list[str]):
        self.proc, self.address, self.lines = proc, address, lines

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)


@contextmanager
def serve(model_dir: Path, tp: int = 2, config: str | None = None, extra: list[str] | None = None,
          tmp_path: Path | None = None, ready_timeout: float = 120) -> Iterator[Server]:
    """`lockstep serve` in its own process group; yields once it prints `ready <address>`."""
    address = f"tcp://127.0.0.1:{free_port()}"
    args = [sys.executable, "-m", "launch.cli", "serve", "--model", str(model_dir), "--tp", str(tp),
            "--address", address, *(extra or [])]
    if config is not None:
        path = (tmp_path or Path("/tmp")) / f"serve-{free_port()}.toml"
        path.write_text(config)
        args += ["--config", str(path)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
                            start_new_session=True)
    lines: list[str] = []
    ready: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready "):
                ready.put(line.split()[1])
        ready.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        try:
            got = ready.get(timeout=ready_timeout)
        except queue.Empty:
            got = None
        if got is None:
            raise AssertionError("server did not become ready:\n" + "".join(lines)[-4000:])
        yield Server(proc, got, lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


def rank_pid(server: Server, rank: int, timeout: float = 10) -> int:
    """The pid of one rank of the server (found through its RANK environment variable)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            if b"launch.serve" in cmd and f"RANK={rank}".encode() in env and server.address.encode() in cmd:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} not found")
