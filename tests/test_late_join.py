"""A rank that starts late still joins its group (launch/serve.py `join_attempt_group`, cluster/dist.py
`JOIN_TIMEOUT`): on a loaded host a restarted Ray actor took more than the 6 s failure timeout to reach the store,
and the restart failed. Once joined, the group's collectives fail after the configured timeout."""

from __future__ import annotations

import re

import pytest

from tests.conftest import run_ranks


@pytest.mark.slow
def test_a_rank_starting_late_joins_and_the_group_keeps_its_short_timeout():
    late = 3.0  # seconds, three times the group's 1 s timeout
    result = run_ranks("late_join_rank.py", [str(late)], nproc=2, timeout=120)
    assert result.returncode == 0, result.stdout
    assert "rank 0 joined" in result.stdout and "rank 1 joined" in result.stdout, result.stdout
    failed = re.search(r"the barrier failed after ([\d.]+) s", result.stdout)
    assert failed, result.stdout
    assert float(failed.group(1)) < late, result.stdout
