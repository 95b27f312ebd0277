"""A `lockstep serve` whose ranks are forked by the test ranks' zygote (tests/local_ranks.py): the ranks
`lockstep serve` would start through torchrun (`python -m launch.serve` with torchrun's environment, one OpenMP
thread each), without torchrun's agent and its imports. For the tests of the server; those of the launcher
(restarts, a rank killed and found by its command line) keep `tests/serving.py`'s torchrun path."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator

from launch.serve import weights_record_path
from launch.torchrun import free_port
from tests.local_ranks import ForkedRank, fork_ranks, kill_ranks, ranks_base_env

FLAGS = ("--http",)  # the `lockstep serve` flags launch.serve takes as they are (the others are the launcher's)


class ForkedServer:
    def __init__(self, ranks: list[ForkedRank], out: str, address: str):
        self.ranks, self.out, self.address = ranks, out, address
        self.returncode: int | None = None

    @property
    def log(self) -> str:
        with open(self.out) as f:
            return f.read()

    def stop(self) -> int | None:
        """SIGINT to every rank (as torchrun passes a user's on), SIGKILL to what is left after 30 s; the first
        non-zero exit code, else 0."""
        for rank in self.ranks:
            with suppress(ProcessLookupError):
                os.killpg(rank.pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        while any(r.poll() is None for r in self.ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        kill_ranks(self.ranks)
        self.returncode = next((r.returncode for r in self.ranks if r.returncode), 0)
        return self.returncode


def launcher_args(extra: list[str]) -> list[str]:
    """The FLAGS of `extra` and their values; other flags (`--max-restarts`) are torchrun's, which is not here."""
    kept = []
    for i, arg in enumerate(extra):
        if arg in FLAGS:
            kept += extra[i:i + 2]
    return kept


@contextmanager
def forked_server(model_dir: Path, tp: int, config: str | None, extra: list[str],
                  ready_timeout: float) -> Iterator[ForkedServer]:
    address = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="lockstep-forked-") as run:
        args = ["--model", str(model_dir), "--address", address, "--state-file", weights_record_path(run),
                *launcher_args(extra)]
        if config is not None:
            preset = os.path.join(run, "preset.toml")
            with open(preset, "w") as f:
                f.write(config)
            args += ["--config", preset]
        out = os.path.join(run, "out.log")
        open(out, "w").close()
        server = ForkedServer(fork_ranks("launch.serve", args, tp, ranks_base_env(), out), out, address)
        try:
            deadline = time.monotonic() + ready_timeout
            while not (ready := [x for x in server.log.splitlines() if x.startswith("ready ")]):
                if time.monotonic() > deadline or any(r.poll() is not None for r in server.ranks):
                    raise RuntimeError("lockstep serve (forked ranks) did not become ready:\n" + server.log[-4000:])
                time.sleep(0.1)
            server.address = ready[0].split()[1]
            yield server
        finally:
            server.stop()
