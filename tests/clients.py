"""Client functions run in spawn processes, their results collected through a queue.

A child that dies (a crash, os._exit, a signal) fails the test at once with its exit code, and a child that
raises fails it with the child's traceback, instead of leaving the test waiting for its queue timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from typing import Any, Callable, Sequence


def _child(index: int, fn: Callable[..., Any], args: tuple, results: "mp.Queue") -> None:
    try:
        value = fn(*args)
    except BaseException:
        results.put((index, False, traceback.format_exc()))
        raise SystemExit(1)
    results.put((index, True, value))


def _take(results: "mp.Queue", got: dict[int, tuple[bool, Any]], wait: float) -> None:
    """Move what the children reported so far into `got` (waiting up to `wait` s for the first item)."""
    try:
        index, ok, value = results.get(timeout=wait)
    except queue.Empty:
        return
    got[index] = (ok, value)
    while True:
        try:
            index, ok, value = results.get_nowait()
        except queue.Empty:
            return
        got[index] = (ok, value)


def run_clients(fn: Callable[..., Any], arg_lists: Sequence[tuple], timeout: float = 600.0) -> list[Any]:
    """`fn(*args)` in one spawn process per entry of `arg_lists` (fn must be importable: a module-level
    function); their return values, in order. Raises AssertionError as soon as a child dies or raises, or
    when `timeout` passes; every child still running is then killed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(k, fn, tuple(args), results), daemon=True)
             for k, args in enumerate(arg_lists)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < len(procs):
            _take(results, got, wait=0.2)
            for k, (ok, value) in got.items():
                if not ok:
                    raise AssertionError(f"client process {k} raised:\n{value}")
            for k, p in enumerate(procs):
                if k not in got and p.exitcode is not None:
                    _take(results, got, wait=2.0)  # its last words may still be in the pipe
                    if k not in got:
                        raise AssertionError(f"client process {k} died with exit code {p.exitcode} "
                                             "before reporting a result")
            if time.monotonic() > deadline:
                missing = [k for k in range(len(procs)) if k not in got]
                raise AssertionError(f"client processes {missing} reported nothing within {timeout} s")
        for k, (ok, value) in got.items():
            if not ok:
                raise AssertionError(f"client process {k} raised:\n{value}")
        return [got[k][1] for k in range(len(procs))]
    finally:
        for p in procs:
            p.join(5 if p.exitcode is None and len(got) == len(procs) else 0)
            if p.exitcode is None:
                p.kill()
                p.join(5)
        results.close()
