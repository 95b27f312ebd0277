"""A rank forked by tests/rank_zygote.py ends as `python -u script` would: its exit code, traceback, atexit
handlers, non-daemon threads and session, and the rank's own environment and argv."""

from __future__ import annotations

import os
import signal
import time
from contextlib import suppress

import pytest

from tests.conftest import REPO, run_ranks


@pytest.mark.slow
@pytest.mark.parametrize("how,code", [("ok", 0), ("exit3", 3), ("raise", 1)])
def test_a_forked_rank_ends_as_a_fresh_interpreter_would(how, code):
    result = run_ranks("zygote_probe.py", [how], nproc=1, timeout=60)  # one rank: a failing one kills its peers
    assert result.returncode == code, result.stdout
    out = result.stdout
    assert f"rank 0 of 1 session leader True main __main__ argv ['{how}']" in out, out
    assert "atexit ran" in out and "thread joined" in out, out
    assert ("ValueError: from the script" in out) == (how == "raise"), out


@pytest.mark.slow
def test_hung_forked_ranks_are_killed_at_the_timeout():
    with pytest.raises(AssertionError, match="zygote_probe.py timed out after 3s"):
        run_ranks("zygote_probe.py", ["hang"], nproc=2, timeout=3)


@pytest.mark.slow
def test_a_rank_outlives_its_zygote_being_retired(tmp_path):
    """A zygote is retired once ZYGOTES_KEPT newer environments were used; a rank it forked and that still runs (a
    session's server) must still be polled to its end, not fail with "the rank zygote exited"."""
    from tests.local_ranks import ZYGOTES_KEPT, fork_ranks, ranks_base_env, zygote_for

    out = str(tmp_path / "out")
    open(out, "w").close()
    (rank,) = fork_ranks(REPO / "tests" / "scripts" / "zygote_probe.py", ["hang"], 1, ranks_base_env({"PROBE": "first"}), out)
    try:
        for k in range(ZYGOTES_KEPT):  # newer environments retire the first one
            zygote_for(ranks_base_env({"PROBE": f"newer{k}"}))
        assert rank.poll() is None  # still running, and its zygote still answers for it
        os.kill(rank.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while rank.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank.returncode == -signal.SIGKILL, open(out).read()[-2000:]
    finally:
        with suppress(ProcessLookupError):
            os.kill(rank.pid, signal.SIGKILL)
