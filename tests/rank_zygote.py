"""A process that imports once what every test rank imports, then forks the ranks from itself (tests/local_ranks.py).

A rank script's interpreter spends ~3 CPU-s importing numpy, torch, torch.distributed, transformers and a config
class (the last pulls in torch.distributed.tensor), before any of its own work; the suite starts some fifty ranks
on two cores. Forked from here, each starts with those modules loaded. It is still a process of its own (its own
pid and session, killed and reaped as one), with the rank's environment and argv, its stdout and stderr in the
test's file, and `__main__` run the way `python -u script` runs it: atexit handlers and non-daemon threads at the
end, SystemExit's code as the exit code.

What the child shares with a fresh interpreter must be all it shares: the zygote starts with the ranks' environment
(tests/local_ranks.py keeps one zygote per environment; only the rank variables are set in the child), imports no
project module (those read the environment when imported), runs no torch op (so no OpenMP pool exists to fork), and
its one thread besides the main one is OpenBLAS's pool, which OpenBLAS stops before a fork (its pthread_atfork handler).

Protocol, one JSON object a line: the test process writes {"path" or "module", "args", "env", "cwd", "out"} on stdin
and reads {"pid": N} back; when a child ends, {"exit": pid, "code": rc} (rc as Popen's returncode: -N for signal N).
At EOF on stdin the zygote forks no more, and exits once every rank it forked has ended (a retired
zygote still reports its ranks' exits).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import sys
import threading
import traceback

PRELOAD = ("numpy", "torch", "torch.distributed", "transformers", "transformers.models.llama.configuration_llama",
           "msgpack", "safetensors.torch")


def run_main(request: dict) -> int:
    """Run the request's script (`path`) or module (`module`, as `python -m`) as `__main__` and end as the
    interpreter would; returns the exit code."""
    try:
        if "module" in request:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(request["path"], run_name="__main__")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  (what the interpreter prints for an uncaught exception)
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  (join non-daemon threads, as interpreter exit does)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def fork_rank(request: dict, control: tuple[int, int]) -> int:
    """Fork a child that runs `request`'s script; returns its pid (in the zygote)."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        for fd in control:
            os.close(fd)
        out = os.open(request["out"], os.O_WRONLY | os.O_APPEND)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        target = request.get("path") or request["module"]
        sys.argv = [target, *request["args"]]
        # as `python script` (the script's folder) or `python -m module` (the working directory) would have it
        sys.path[0] = os.path.dirname(target) if "path" in request else request["cwd"]
        code = run_main(request)
    finally:
        os._exit(code)


def main() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    control = (os.dup(0), os.dup(1))  # fds 0 and 1 become each child's own
    read_fd, write_fd = control

    def send(message: dict) -> None:
        os.write(write_fd, (json.dumps(message) + "\n").encode())

    children: set[int] = set()
    pending = b""
    reading = True
    while reading or children:  # after EOF, on until its ranks end: their exits are still reported
        ready, _, _ = select.select([read_fd] if reading else [], [], [], 0.05)
        if ready:
            data = os.read(read_fd, 1 << 16)
            if not data:
                reading = False
                continue
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = fork_rank(json.loads(line), control)
                children.add(pid)
                send({"pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            children.discard(pid)
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
