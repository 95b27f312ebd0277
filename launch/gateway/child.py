"""`lockstep serve --http`: the HTTP gateway as a child process of rank 0, supervised there.

The gateway (`lockstep http`, launch/gateway/server.py) is a front door client like any other. In a thread of
rank 0 it shared the step loop's GIL (in benchmarks/serving.py --http it added 12 ms a token over the ZeroMQ path;
as a process, 6 ms). The child is restarted with a growing pause when it exits while the group serves; it runs in
a session of its own, so a signal to rank 0's process group reaches rank 0 alone, and it leaves by itself when rank
0 is gone (`--exit-with-parent`), so no gateway holds the port. The admin token goes in the environment
(LOCKSTEP_HTTP_ADMIN_TOKEN), never on its command line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from cluster.http_config import HTTP_ADMIN_TOKEN_ENV

log = logging.getLogger("lockstep")

REPO = Path(__file__).resolve().parents[2]
PORT_WAIT_S = 5.0  # a gateway left by a rank 0 killed outright lets its port go within about 2 s
MAX_PAUSE_S = 30.0


class GatewayProcess:
    """The gateway of `lockstep serve --http`, as a supervised child process (rank 0 only)."""

    def __init__(self, address: str, listen: str, model_dir: str | None, admin_token: str | None,
                 admin_trust: tuple[str, ...] = (), memory_saver: bool = False):
        """`admin_trust`: the networks whose callers reach the admin routes without the token (cluster/http_config.py
        http_admin_trust; they go on the command line: they are no secret); `memory_saver`: SGLang's
        `enable_memory_saver` (cluster/http_config.py sglang_enable_memory_saver)."""
        self.listen = listen
        self.command = [sys.executable, "-m", "launch.cli", "http", "--address", address, "--listen", listen,
                        "--exit-with-parent", str(os.getpid())]
        if model_dir:
            self.command += ["--model", str(model_dir)]
        if admin_trust:
            self.command += ["--admin-trust", ",".join(admin_trust)]
        if memory_saver:
            self.command.append("--sglang-enable-memory-saver")
        self.env = {k: v for k, v in os.environ.items() if k != HTTP_ADMIN_TOKEN_ENV}
        self.env |= {HTTP_ADMIN_TOKEN_ENV: admin_token} if admin_token else {}
        pythonpath = [str(REPO), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in pythonpath if p)
        self.proc: subprocess.Popen | None = None
        self.stopping = threading.Event()

    def start(self, timeout: float = 120.0) -> "GatewayProcess":
        """Start the child and return once it listens; RuntimeError when it cannot, or the port stays in use."""
        if not port_free(self.listen, PORT_WAIT_S):
            raise RuntimeError(f"the HTTP gateway cannot listen on {self.listen}: the address is in use")
        ok, last = self._spawn(timeout)
        if not ok:
            raise RuntimeError(f"the HTTP gateway did not start on {self.listen}:\n{last}")
        threading.Thread(target=self._supervise, name="lockstep-http-supervisor", daemon=True).start()
        return self

    def _spawn(self, timeout: float) -> tuple[bool, str]:
        """One start: (listening, its last output lines)."""
        # a session of its own: a SIGINT to rank 0's process group must not end the gateway before rank 0 does
        proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=self.env, cwd=REPO, start_new_session=True)
        listening = threading.Event()
        tail: list[str] = []

        def pump() -> None:  # pass the child's output on; note when it listens
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                tail[:] = (tail + [line])[-20:]
                if line.startswith("http http"):
                    listening.set()
            listening.set()  # it ended: start() looks at proc.poll()

        threading.Thread(target=pump, name="lockstep-http-output", daemon=True).start()
        if listening.wait(timeout) and proc.poll() is None:
            self.proc = proc
            return True, ""
        proc.kill()
        proc.wait()
        return False, "".join(tail)

    def _supervise(self) -> None:
        """Start the child again whenever it exits while rank 0 still serves."""
        pause = 1.0
        while not self.stopping.is_set():
            proc = self.proc
            code = proc.wait() if proc is not None else None
            if self.stopping.is_set():
                return
            log.error("the HTTP gateway (pid %s) exited with status %s; starting it again in %.0f s", proc.pid,
                      code, pause)
            if self.stopping.wait(pause):
                return
            ok, last = port_free(self.listen, PORT_WAIT_S) and self._spawn(120.0) or (False, "the address is in use")
            if not ok:
                log.error("the HTTP gateway did not start again:\n%s", last)
            pause = 1.0 if ok else min(2 * pause, MAX_PAUSE_S)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the child (SIGTERM, then SIGKILL) and its supervision."""
        self.stopping.set()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def port_free(listen: str, wait_s: float) -> bool:
    """Whether HOST:PORT can be bound (as the gateway binds it), trying for up to `wait_s`."""
    from launch.gateway.server import bind_listen, parse_listen

    host, port = parse_listen(listen)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            bind_listen(host, port).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
        time.sleep(0.2)
