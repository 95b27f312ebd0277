"""Starting N ranks with torch's own launcher (`python -m torch.distributed.run`)."""

from __future__ import annotations

import socket
import sys


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, module: str, args: list[str]) -> list[str]:
    """The command line that runs `python -m module args` on `nproc` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args]
