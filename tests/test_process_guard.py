"""tests/process_guard.py: a test that is not marked slow cannot start a process, by any of the ways there are."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from tests.conftest import run_ranks
from tests.process_guard import UnmarkedProcessStart


@pytest.mark.parametrize("start", [
    lambda: subprocess.run([sys.executable, "-c", "pass"], check=True),
    lambda: subprocess.Popen(["true"]),
    lambda: os.fork(),
    lambda: os.posix_spawn("/bin/true", ["true"], dict(os.environ)),
    lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    lambda: run_ranks("zygote_probe.py", ["ok"], nproc=1, timeout=60),  # forked by the zygote (tests/local_ranks.py)
], ids=["subprocess.run", "Popen", "fork", "posix_spawn", "multiprocessing", "forked rank"])
def test_an_unmarked_test_cannot_start_a_process(start, request):
    with pytest.raises(UnmarkedProcessStart, match=request.node.name.split("[")[0]):
        start()


@pytest.mark.slow
def test_a_slow_test_may_start_one():
    assert subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True,
                          check=True).stdout == "42\n"
