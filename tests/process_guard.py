"""The fast tier starts no process: a test (or a fixture it uses) that starts one fails unless it is marked slow.

The `slow` marker's meaning (pyproject.toml) is "starts processes (torchrun, servers, Ray, the CLI) or compiles";
`python -m pytest -m "not slow" tests` is the fast tier a developer runs while working, and it stays fast only
while every test that starts a process carries the marker. So while a test that is not marked slow runs (its
setup, its call, its teardown, and the fixtures of any scope set up for it), every way this interpreter starts a
process (`subprocess`, `os.fork`, `os.posix_spawn`, `multiprocessing`) raises `UnmarkedProcessStart`, naming
the test and the command. tests/conftest.py installs it; tests/test_process_guard.py shows that it fires.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from typing import Any, Callable, Iterator

import pytest


class UnmarkedProcessStart(RuntimeError):
    """A test that is not marked slow started a process."""

    code = "unmarked_process_start"


_current: list[pytest.Item] = []  # the test being run, while it is not marked slow


def refuse_unless_slow(what: str, command: str) -> None:
    """Raise UnmarkedProcessStart if a test that is not marked slow is running (a process another one starts for
    this interpreter, as tests/local_ranks.py's zygote does, counts as this test's)."""
    if _current:
        raise UnmarkedProcessStart(
            f"{_current[0].nodeid} starts a process ({what}: {command[:120]}) but is not "
            "marked slow; mark it @pytest.mark.slow (the fast tier starts no process) and keep a fast "
            "in-process test of the logic beside it")


def _guarded(what: str, original: Callable[..., Any], describe: Callable[..., str]) -> Callable[..., Any]:
    def start(*args: Any, **kwargs: Any) -> Any:
        refuse_unless_slow(what, describe(*args, **kwargs))
        return original(*args, **kwargs)

    start.__wrapped__ = original  # type: ignore[attr-defined]
    return start


def install() -> None:
    """Wrap every way of starting a process once per interpreter (each xdist worker installs its own)."""
    if hasattr(subprocess.Popen._execute_child, "__wrapped__"):  # type: ignore[attr-defined]
        return
    subprocess.Popen._execute_child = _guarded(  # type: ignore[attr-defined]
        "subprocess", subprocess.Popen._execute_child, lambda self, args, *a, **k: repr(args))  # type: ignore
    os.fork = _guarded("os.fork", os.fork, lambda: "")
    os.posix_spawn = _guarded("os.posix_spawn", os.posix_spawn, lambda path, *a, **k: repr(path))
    multiprocessing.process.BaseProcess.start = _guarded(  # type: ignore[method-assign]
        "multiprocessing", multiprocessing.process.BaseProcess.start, lambda self: repr(self))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Refuse process starts for the whole of an unmarked test: setup (fixtures of every scope), call, teardown."""
    install()
    guarded = item.get_closest_marker("slow") is None
    if guarded:
        _current.append(item)
    try:
        yield
    finally:
        if guarded:
            _current.remove(item)
