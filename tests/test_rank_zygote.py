"""A rank forked by tests/rank_zygote.py ends as `python -u script` would: its exit code, traceback, atexit
handlers, non-daemon threads and session, and the rank's own environment and argv."""

from __future__ import annotations

import pytest

from tests.conftest import run_ranks


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
