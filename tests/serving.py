"""Start a real `lockstep serve` for a test and stop every process it started."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from launch.local_server import LocalServer, local_server
from launch.torchrun import free_port
from tests.serving_forked import ForkedServer, forked_server


def fast_config(client_timeout_s: float = 2.0, page_size: int = 16, cpu_group_timeout: float = 5.0) -> str:
    """The small TP=2 preset the serving tests share: 16-token pages, a 5 s control timeout (unless told)."""
    return f"""
[continuous_batching]
page_size = {page_size}
max_batch_tokens = 256
max_requests_per_batch = 64
cpu_group_timeout = {cpu_group_timeout}

[serve]
client_timeout_s = {client_timeout_s}
"""


@contextmanager
def serve(model_dir: Path, tp: int = 2, config: str | None = None, extra: list[str] | None = None,
          ready_timeout: float = 300, forked: bool = False) -> Iterator[LocalServer | ForkedServer]:
    """`lockstep serve` in its own process group (one thread a rank); yields once it prints `ready`. `forked`: the
    ranks of `python -m launch.serve` forked by the test ranks' zygote instead (tests/serving_forked.py), for a
    test of the server rather than of its launcher (no torchrun: no restart, no `rank_pid`)."""
    if forked:
        with forked_server(model_dir, tp, config, extra or [], ready_timeout) as server:
            yield server
        return
    with local_server(model_dir, tp, config, extra, env={"OMP_NUM_THREADS": "1"},
                      ready_timeout=ready_timeout) as server:
        yield server


@contextmanager
def http_serve(model_dir: Path, more_config: str = "") -> Iterator[ForkedServer]:
    """A TP=2 forked `lockstep serve --http` with admin token HTTP_ADMIN_TOKEN; `.http` is its base URL."""
    from tests.conftest import HTTP_ADMIN_TOKEN  # here: benchmarks import this module, conftest sets one thread

    port = free_port()
    config = fast_config() + f'http_admin_token = "{HTTP_ADMIN_TOKEN}"\n' + more_config
    with serve(model_dir, 2, config, extra=["--http", f"127.0.0.1:{port}"], forked=True) as s:
        s.http = f"http://127.0.0.1:{port}"
        yield s


def rank_pid(server: LocalServer, rank: int, timeout: float = 10) -> int:
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


def wait_until(check, timeout: float, what: str) -> None:
    """Poll `check()` every 0.2 s until it is true; AssertionError naming `what` past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s: {what}")
