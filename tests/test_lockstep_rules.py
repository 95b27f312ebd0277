"""The lockstep rules are asserted in code, not left as conventions: only the loop thread talks on the
control group while a loop runs, except the holders of a pause between its barriers."""

from __future__ import annotations

import pytest

import cluster
from cluster.dist import ControlThreadError, agree_all_ok


def test_only_the_loop_thread_uses_the_control_group(make_checkpoint):
    model = cluster.load(make_checkpoint("llama"))
    m = model.init_continuous_batching(continuous_batching_config=cluster.ContinuousBatchingConfig(page_size=16))
    assert agree_all_ok(True, m.groups) == [True]  # no loop yet: the caller may
    m.start()
    try:
        with pytest.raises(ControlThreadError, match="only the loop thread"):
            agree_all_ok(True, m.groups)
        with m.pause():  # the loop is parked and lends the channel to the holders
            assert agree_all_ok(True, m.groups) == [True]
        rid = m.add_request([1, 2, 3], max_new_tokens=3)  # the loop has left the park once this is done
        assert len(m.get_result(rid, timeout=30).generated_tokens) == 3
        with pytest.raises(ControlThreadError):
            agree_all_ok(True, m.groups)
    finally:
        m.stop()
        m.destroy()
    assert agree_all_ok(True, m.groups) == [True]  # the loop ended: the channel is free again
