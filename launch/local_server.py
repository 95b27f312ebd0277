"""A `lockstep serve` on this machine, as a child process group: started, awaited until it prints
`ready <address>`, and stopped with every process it started. Tests and benchmarks share it."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator

from launch.torchrun import free_port

REPO = Path(__file__).resolve().parents[1]


class LocalServer:
    def __init__(self, proc: subprocess.Popen, address: str, lines: list[str]):
        self.proc, self.address, self.lines = proc, address, lines
        self.returncode: int | None = None

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> int | None:
        """SIGINT to the group, then SIGKILL to anything the launcher left behind; the launcher's exit code."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            with suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.returncode = None
        with suppress(subprocess.TimeoutExpired):
            self.returncode = self.proc.wait(10)
        return self.returncode


@contextmanager
def local_server(model_dir: str | os.PathLike, tp: int = 1, config: str | None = None,
                 extra: list[str] | None = None, env: dict[str, str] | None = None,
                 ready_timeout: float = 120) -> Iterator[LocalServer]:
    """Run `lockstep serve --model model_dir --tp tp` (config: TOML text) until the block ends."""
    address = f"tcp://127.0.0.1:{free_port()}"
    args = [sys.executable, "-m", "launch.cli", "serve", "--model", str(model_dir), "--tp", str(tp),
            "--address", address, *(extra or [])]
    preset = None
    if config is not None:
        with tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="lockstep-serve-", delete=False) as f:
            f.write(config)
        preset = f.name
        args += ["--config", preset]
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=full_env, start_new_session=True)
    lines: list[str] = []
    ready: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready "):
                ready.put(line.split()[1])
        ready.put(None)

    pumper = threading.Thread(target=pump, daemon=True)
    pumper.start()
    server = LocalServer(proc, address, lines)
    try:
        got = None
        with suppress(queue.Empty):
            got = ready.get(timeout=ready_timeout)
        if got is None:
            raise RuntimeError("lockstep serve did not become ready:\n" + "".join(lines)[-4000:])
        server.address = got
        yield server
    finally:
        server.stop()
        pumper.join(5)
        if preset:
            os.unlink(preset)
