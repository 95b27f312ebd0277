"""Starting N ranks with torch's own launcher (`python -m torch.distributed.run`)."""

from __future__ import annotations

import random
import socket
import sys


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for another process to bind soon. Chosen at random below the kernel's ephemeral range,
    so that no outgoing connection (gloo's, a client's) can be handed it in between, as one bound to port 0
    could be: many servers starting on one host at once then do not take each other's ports."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for port in (random.randrange(10000, low) for _ in range(50)) if low > 11000 else ():
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, module: str, args: list[str]) -> list[str]:
    """The command line that runs `python -m module args` on `nproc` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args]
